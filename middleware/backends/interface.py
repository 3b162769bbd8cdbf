"""What every backend answers, and the records it hands the runtime.

The pipeline (``middleware/pipeline.py``) asks the registry (``backends/__init__.py``) for
the backend of the plan's device and calls, in order: :meth:`Backend.lower` (device
rewrites of the passed graph), :meth:`Backend.units` (one :class:`Unit` per call of the
plan: generated kernels for io groups, vendor calls, framework calls, fallbacks) and, once
the runtime has built the plan from the units, :meth:`Backend.finish` (e.g. CUDA-graph
capture). :meth:`Backend.can_run` says which groups a backend generates code for, with the
reason when it does not.

:class:`Unit` and the helpers below are the contract between the backends and the runtime:
they live here, below the runtime, so that no backend imports a stage above it.
"""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from ..enums import RunsAs
from ..graph import Graph, Node
from ..hardware import Hardware
from ..ops import get_op
from ..options import Options


@dataclasses.dataclass(frozen=True)
class Unit:
    """What a backend hands the plan builder: one call and the values it reads and writes."""

    name: str
    runs_as: RunsAs
    fn: Callable[..., Any]
    inputs: Sequence[str]
    outputs: Sequence[str]
    nodes: Sequence[str]
    reason: str = ""
    # Destination-passing form, when the unit has one: ``out_fn(*inputs, *outputs)`` writes
    # into preallocated output tensors (generated kernels have it; the memory planner uses it).
    out_fn: Callable[..., None] | None = None
    # The algorithm a vendor op runs as (backends/vendor/algorithms.py), "" for others.
    algorithm: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.runs_as, RunsAs):
            object.__setattr__(self, "runs_as", RunsAs(self.runs_as))


class _Scratch:
    """The placeholder for a scratchpad argument of a :class:`NativeCall`."""

    def __repr__(self) -> str:
        return "SCRATCH"


SCRATCH = _Scratch()


@dataclasses.dataclass(frozen=True, eq=False)
class Workspace:
    """A buffer of ``nbytes`` that one step's calls share (a source converted for the next
    call): the native runner gives each its own memory, kept between calls."""

    nbytes: int


@dataclasses.dataclass(frozen=True)
class NativeCall:
    """A step's call as one C function and its arguments, for the runtime's native runner
    (``runtime/native.py``: a whole plan as one C call, no Python between steps).

    A destination form (``Unit.out_fn``) or an in-place form may offer
    ``native(*tensors) -> NativeCall | list[NativeCall] | None``: the same computation the
    form does on those very tensors (its inputs, then its outputs), as C calls in order,
    or None where it cannot be (a layout the kernel does not read).
    ``fn``: the function's address (or the name of a function of the native runner's own
    library, ``backends/x86/runner.py``: ``mw_strided_copy``); every argument is passed as a 64-bit integer, at most
    48 (``backends/x86/runner.MAX_ARGS``). ``args``: a tensor (its data pointer; the runtime maps it to an input, the
    output or the arena, and refuses any other memory), an ``int`` (a constant the call's
    owner keeps alive: a primitive's handle, a held weight's address), :data:`SCRATCH`
    (a scratchpad of ``scratch_bytes`` the runtime provides, one call at a time) or a
    :class:`Workspace` (memory of its own, shared by the calls that name it).
    ``status``: the function returns an ``int``, nonzero on failure (else ``void``)."""

    fn: int | str  # an address, or the name of a function of the runner's own library
    args: tuple[Any, ...]
    status: bool = False
    scratch_bytes: int = 0
    keep: tuple[Any, ...] = ()  # what a constant argument points into (kept with the program)


def native_address(cfunc: Any) -> int:
    """The address of a ctypes function."""
    return int(ctypes.cast(cfunc, ctypes.c_void_p).value or 0)


def holds_inputs(fn: Callable[..., Any], positions: Sequence[int]) -> Callable[..., Any]:
    """Mark ``fn`` as never reading its inputs at ``positions``: it holds its own copy of
    those constants (a prepacked or transformed weight, a bias captured when it was built).
    The plan builder then keeps no constant for a parameter that no step reads
    (``runtime.plan.build_plan``), and the pipeline drops its array from the graph, so the
    weight is held once. Returns ``fn``."""
    fn.holds_inputs = tuple(sorted(set(positions)))  # type: ignore[attr-defined]
    return fn


def held_inputs(fn: Callable[..., Any]) -> tuple[int, ...]:
    """The input positions ``fn`` never reads (:func:`holds_inputs`); () if unmarked."""
    return getattr(fn, "holds_inputs", ())


def to_tensor(array: np.ndarray, device: torch.device, layout: str = "nchw") -> torch.Tensor:
    """A graph constant as a framework tensor on ``device`` (the one conversion of constants)."""
    t = torch.from_numpy(np.ascontiguousarray(array))
    if device.type != "cpu":
        t = t.to(device)
    if layout == "nhwc" and t.dim() == 4:
        t = t.contiguous(memory_format=torch.channels_last)
    return t


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether ``a`` and ``b`` are one device. ``torch.device("cuda")`` names the current
    CUDA device, so it is the same device as ``torch.device("cuda", 0)`` while device 0 is
    current, although ``==`` on the two says not (a plan is built for
    ``torch.device(options.device)``; a model's tensors report ``cuda:0``)."""
    if a.type != b.type:
        return False
    if a.index == b.index:
        return True
    if a.type != "cuda":
        return (a.index or 0) == (b.index or 0)
    current = torch.cuda.current_device()
    return (current if a.index is None else a.index) == (current if b.index is None else b.index)


def users_tensor(
    array: np.ndarray, source: Any, device: torch.device, layout: str = "nchw"
) -> torch.Tensor | None:
    """The user's own tensor behind graph constant ``array``, where it can serve as the
    constant as it is: the frontend recorded it as ``source`` (``(array, tensor)``:
    ``graph.meta[PARAM_SOURCES]``), the graph still holds that very array (not a pass's
    transformed copy), and the tensor is on ``device``, float32 and stored as ``layout``
    asks. None otherwise."""
    if source is None:
        return None
    src_array, tensor = source
    if (
        src_array is array
        and same_device(tensor.device, device)
        and tensor.dtype == torch.float32
        and tuple(tensor.shape) == array.shape
        and (
            tensor.is_contiguous(memory_format=torch.channels_last)
            if layout == "nhwc" and tensor.dim() == 4
            else tensor.is_contiguous()
        )
    ):
        return tensor
    return None


def constant_tensor(
    array: np.ndarray, source: Any, device: torch.device, layout: str = "nchw"
) -> torch.Tensor:
    """A graph constant as a framework tensor on ``device``: the user's own tensor where
    :func:`users_tensor` finds it, else a copy (:func:`to_tensor`). Sharing keeps one copy
    of unchanged weights on a GPU (the frontend's numpy array is a host copy there); a
    changed weight rebuilds the plan (``runtime.weights``) either way."""
    own = users_tensor(array, source, device, layout)
    return own if own is not None else to_tensor(array, device, layout)


def node_step(
    graph: Graph, node: Node, device: torch.device
) -> tuple[RunsAs, Callable[..., Any], str]:
    """The default way to run one node: its catalogue implementation through the framework
    (a fallback node: the original callable, with the frontend's reason)."""
    op = get_op(node.op)
    if node.op == "fallback":
        return RunsAs.FALLBACK, op.bind(node), str(node.attrs.get("reason", ""))
    return RunsAs.VENDOR, op.bind(node), ""


def node_unit(graph: Graph, node: Node, device: torch.device) -> Unit:
    """:func:`node_step` as the node's own unit."""
    runs_as, fn, reason = node_step(graph, node, device)
    return Unit(node.name, runs_as, fn, node.inputs, node.outputs, (node.name,), reason)


@runtime_checkable
class Backend(Protocol):
    """One way to run a graph on one kind of device.

    ``name``: the registry key ("x86", "ispc", "cuda", ...). ``device_type``: the
    ``torch.device`` type it runs on ("cpu", "cuda"). ``slices_batch``: whether
    ``Options(batch_chunk="auto")`` may run a network's prefix over slices of the batch
    on this device (the batch-slicing pass asks; a number of samples always slices).
    Optional ``tunes_whole_plans`` (False when absent): whether conv2d "autotune"/"auto"
    also choose the network's plan as a whole (``pipeline.network_choice``: the CPU, where
    whole plans are timed on the host).
    """

    name: str
    device_type: str
    slices_batch: bool

    def check_runtime(self) -> None:
        """Raise :class:`~middleware.errors.DeviceError` naming what is missing (and how to
        install it) when this backend cannot run on this machine; ``optimize`` asks before
        it compiles anything."""
        ...

    def can_run(
        self,
        graph: Graph,
        nodes: Sequence[str],
        hardware: Hardware,
        options: Options | None = None,
    ) -> tuple[bool, str]:
        """Whether this backend generates one kernel for the group ``nodes``; when not,
        the reason."""
        ...

    def passes_off(self, options: Options) -> tuple[str, ...]:
        """Passes of the pipeline this backend turns off for ``options`` (beyond
        ``options.disable_passes``): e.g. batch-norm folding where the plan must not hold
        folded copies of the weights."""
        ...

    def lower(self, graph: Graph, options: Options) -> Graph:
        """The device's own rewrites of a passed graph (identity where there are none)."""
        ...

    def units(
        self, graph: Graph, options: Options, hardware: Hardware, device: torch.device
    ) -> list[Unit]:
        """The plan's units for ``graph`` (lowered), in a valid execution order."""
        ...

    def finish(self, plan: Any, options: Options, inputs: Sequence[torch.Tensor] | None) -> Any:
        """The plan as it runs on the device (e.g. wrapped for CUDA-graph replay and
        captured on ``inputs``); ``plan`` itself where there is nothing to add."""
        ...
