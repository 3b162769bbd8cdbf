"""The x86 code generators: ordered stages schedule -> render -> compile -> load (the
pipeline's CPU backend, ``backends/cpu``, builds its io groups' kernels with them).

``X86Backend().build(graph, nodes, options, hardware)`` returns a :class:`GeneratedKernel`
whose ``fn(*inputs)`` allocates the output (``torch.empty`` on the inputs' device, in the
output value's layout) and whose ``out_fn(*inputs, *outputs)`` writes into given tensors.
"""

from __future__ import annotations

import ctypes
import dataclasses
import shutil
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ...graph import Graph
from ...hardware import Hardware
from ...loops import Call, NotFusable
from ...options import Options
from ...passes.schedule import Schedule, schedule_group
from ..interface import NativeCall, Workspace, native_address
from . import index, window
from .cfuncs import UNSUPPORTED_ISPC
from .compile import Built, build_c, build_ispc
from .render import render_c, render_ispc
from .runner import MAX_ARGS, strided_copy


@dataclasses.dataclass(frozen=True)
class GeneratedKernel:
    """A loaded kernel for one group: value names in argument order and the two call forms."""

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    fn: Callable[..., Any]
    out_fn: Callable[..., None]
    source_path: Path
    schedule: Schedule | None  # None when loaded through the group index
    compiled: bool


_LIBS: dict[Path, ctypes.CDLL] = {}
# Scheduling and rendering (islpy, one shared isl context) run one at a time; compiles of
# several groups may overlap (fusion_units builds groups from a thread pool).
_SCHEDULE_LOCK = threading.RLock()


def _memory_format(layout: str, rank: int) -> torch.memory_format:
    if rank == 4 and layout == "nhwc":
        return torch.channels_last
    return torch.contiguous_format


def make_callables(
    cfunc: Any, schedule: Schedule, graph: Graph
) -> tuple[Callable[..., Any], Callable[..., None]]:
    """The two Python call forms over a ctypes function, with the per-call work kept to
    data_ptr() ints (inputs in another memory order are made contiguous first)."""
    ins = []
    for name in schedule.inputs:
        b = schedule.buffer(name)
        ins.append((b.layout, len(b.torch_shape)))
    (out_name,) = schedule.outputs
    ob = schedule.buffer(out_name)
    return _callables(cfunc, schedule.name, ins, ob.layout, tuple(ob.torch_shape))


def _callables(
    cfunc: Any,
    name: str,
    ins: Sequence[tuple[str, int]],
    out_layout: str,
    out_shape: tuple[int, ...],
) -> tuple[Callable[..., Any], Callable[..., None]]:
    """make_callables from plain data: (layout, rank) per input, the output's layout/shape."""
    in_formats = [_memory_format(layout, rank) for layout, rank in ins]
    out_format = _memory_format(out_layout, len(out_shape))
    nin = len(in_formats)

    def prepare(xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        ys = list(xs)
        for i, (x, mf) in enumerate(zip(ys, in_formats, strict=True)):
            if not x.is_contiguous(memory_format=mf):
                ys[i] = x.contiguous(memory_format=mf)
        return ys

    def out_fn(*args: torch.Tensor) -> None:
        xs = prepare(args[:nin])
        out = args[nin]
        if not out.is_contiguous(memory_format=out_format):
            raise ValueError(f"{name}: output tensor is not in {out_layout} order")
        cfunc(*[x.data_ptr() for x in xs], out.data_ptr())

    address = native_address(cfunc)

    def native(*args: torch.Tensor) -> list[NativeCall] | None:
        """out_fn as C calls on these very tensors: an input in another order (a channel
        slice of a split) copied into a workspace first, as ``prepare`` copies it, then
        the kernel (None where the output is not in the kernel's order)."""
        if len(args) != nin + 1 or nin + 1 > MAX_ARGS:
            return None
        if not args[nin].is_contiguous(memory_format=out_format):
            return None
        calls, operands = [], list(args)
        for k, (t, f) in enumerate(zip(args[:nin], in_formats, strict=True)):
            if t.is_contiguous(memory_format=f):
                continue
            operands[k] = Workspace(t.numel() * 4)
            copy = strided_copy(
                t.permute(0, 2, 3, 1) if f == torch.channels_last else t, operands[k]
            )
            if copy is None:
                return None
            calls.append(copy)
        return [*calls, NativeCall(address, tuple(operands))]

    out_fn.native = native  # type: ignore[attr-defined]

    def fn(*xs: torch.Tensor) -> torch.Tensor:
        if len(xs) != nin:
            raise TypeError(f"{name} takes {nin} inputs, got {len(xs)}")
        xs = prepare(xs)  # type: ignore[assignment]
        # float32 whatever torch's default dtype is: the kernels are float32 C (only
        # float32 groups are generated)
        out = torch.empty(
            out_shape, dtype=torch.float32, device=xs[0].device, memory_format=out_format
        )
        cfunc(*[x.data_ptr() for x in xs], out.data_ptr())
        return out

    return fn, out_fn


class X86Backend:
    """OpenMP C through the system C compiler."""

    name = "x86"
    stages = ("schedule", "render", "compile", "load")
    use_index = True  # consult the group index (backends/x86/index.py) before scheduling

    def passes_off(self, options: Options) -> tuple[str, ...]:
        """None: every pass of the pipeline runs."""
        return ()

    def can_run(
        self,
        graph: Graph,
        nodes: Sequence[str],
        hardware: Hardware,
        options: Options | None = None,
    ) -> tuple[bool, str]:
        """Whether a group can be generated, and if not, why. With ``options`` the group
        index answers for a group seen before (and records the answer otherwise)."""
        for n in nodes:
            if graph.values[graph.node(n).outputs[0]].dtype != "float32":
                return False, f"{n}: only float32 is generated"
        key = self._index_key(graph, nodes, options, hardware)
        if key is not None:
            assert options is not None
            rec = index.get(options.cache_dir, key)
            if rec is not None:
                return (rec.kind == "kernel", rec.why)
        try:
            # islpy's one shared context is not thread-safe: the same lock as build()
            with _SCHEDULE_LOCK:
                self.schedule(graph, nodes, hardware)
        except NotFusable as e:
            if key is not None:
                assert options is not None
                index.put(options.cache_dir, key, index.IndexRecord("not_fusable", why=str(e)))
            return False, str(e)
        return True, ""

    def _index_key(
        self, graph: Graph, nodes: Sequence[str], options: Options | None, hardware: Hardware
    ) -> str | None:
        if not self.use_index or options is None:
            return None
        try:
            return index.group_key(graph, nodes, options, hardware)
        except Exception:  # noqa: BLE001 - the index is a shortcut; without a key, no shortcut
            return None

    def _load_indexed(self, key: str, options: Options) -> GeneratedKernel | None:
        """The kernel the index records under ``key`` once the cache verified its binary."""
        rec = index.get(options.cache_dir, key)
        if rec is None or rec.kind != "kernel":
            return None
        kernel = index.verified_kernel(options.cache_dir, rec)
        if kernel is None:
            index.forget(options.cache_dir, key)
            return None
        try:
            cfunc = self._cfunc(kernel.binary, rec.function, len(rec.inputs) + 1)
        except (OSError, AttributeError):
            index.forget(options.cache_dir, key)
            return None
        out_value, out_layout, out_shape = rec.output
        fn, out_fn = _callables(
            cfunc, rec.function, [(lay, r) for _, lay, r in rec.inputs], out_layout, out_shape
        )
        return GeneratedKernel(
            rec.function,
            tuple(v for v, _, _ in rec.inputs),
            (out_value,),
            fn,
            out_fn,
            kernel.source_path,
            None,
            False,
        )

    @staticmethod
    def _cfunc(binary: Path, function: str, nargs: int) -> Any:
        lib = _LIBS.get(binary)
        if lib is None:
            lib = ctypes.CDLL(str(binary))
            _LIBS[binary] = lib
        cfunc = getattr(lib, function)
        cfunc.restype = None
        cfunc.argtypes = [ctypes.c_void_p] * nargs
        return cfunc

    def schedule(self, graph: Graph, nodes: Sequence[str], hardware: Hardware) -> Schedule:
        return schedule_group(graph, nodes, hardware)

    def render(self, schedule: Schedule, hardware: Hardware | None = None) -> str:
        """The C source; with ``hardware``, an output larger than the private caches of all
        cores (``l2_bytes * cores``) is written with non-temporal stores."""
        if hardware is None:
            return render_c(schedule)
        return render_c(
            schedule,
            stream_min_bytes=stream_min_bytes(hardware),
            prefetch_hint=prefetch_hint(hardware),
        )

    def compile(
        self, schedule: Schedule, source: str, options: Options, hardware: Hardware
    ) -> Built:
        meta = {
            "group": schedule.name,
            "layers": list(schedule.layers),
            "ops": list(schedule.ops),
            "shapes": {
                b.value: list(b.torch_shape) for b in schedule.buffers if b.role != "scratch"
            },
        }
        return build_c(
            schedule.name,
            source,
            Path(options.cache_dir),
            key_extra=(options.codegen_key(), hardware.key()),
            meta=meta,
        )

    def load(self, schedule: Schedule, built: Built, graph: Graph) -> GeneratedKernel:
        nargs = len(schedule.inputs) + len(schedule.outputs)
        cfunc = self._cfunc(built.binary, schedule.name, nargs)
        fn, out_fn = make_callables(cfunc, schedule, graph)
        return GeneratedKernel(
            schedule.name,
            tuple(schedule.buffer(n).value for n in schedule.inputs),
            tuple(schedule.buffer(n).value for n in schedule.outputs),
            fn,
            out_fn,
            built.source_path,
            schedule,
            built.compiled,
        )

    def build(
        self, graph: Graph, nodes: Sequence[str], options: Options, hardware: Hardware
    ) -> GeneratedKernel:
        """All stages in order; raises NotFusable or CompileError. A group the index knows
        (same key, verified binary) is loaded without scheduling, rendering or compiling."""
        key = self._index_key(graph, nodes, options, hardware)
        if key is not None:
            kernel = self._load_indexed(key, options)
            if kernel is not None:
                return kernel
        try:
            with _SCHEDULE_LOCK:
                schedule = self.schedule(graph, nodes, hardware)
                source = self.render(schedule, hardware)
        except NotFusable as e:
            if key is not None:
                index.put(options.cache_dir, key, index.IndexRecord("not_fusable", why=str(e)))
            raise
        built = self.compile(schedule, source, options, hardware)
        kernel = self.load(schedule, built, graph)
        if key is not None and built.cache_key:
            index.put(options.cache_dir, key, _record(schedule, built))
        return kernel


def stream_min_bytes(hardware: Hardware) -> int:
    """The output size from which a kernel stores non-temporally: more than the L2 caches
    of all cores hold, so the lines would leave the core's caches before the next group
    reads them anyway (measured on the 2-core host: the streaming kernel of
    bench/io_patterns.py is faster with non-temporal stores for every pattern there, all
    of whose outputs exceed 4 MiB)."""
    return hardware.l2_bytes * max(1, hardware.cores)


def prefetch_hint(hardware: Hardware) -> str:
    """The software prefetch hint of the pooling row passes (``window.PREFETCH_HINT``
    says what they prefetch). Into L2 (``_MM_HINT_T1``) on Intel, into L1
    (``_MM_HINT_T0``) on AMD, where T1 and T2 leave the hardware prefetchers behind: on
    the AMD EPYC (Zen 5) host, one core, BN -> ReLU -> 3x3/2 max-pool against the
    streaming kernel of the same bytes, NCHW 71% with T1 and 93% with T0 (no prefetch
    65%), channels_last 76-84% with T1 and 88-90% with T0; on the Intel host T1 led T0 by
    2-5 points (session 8)."""
    return "_MM_HINT_T0" if hardware.amd else window.PREFETCH_HINT


def _record(schedule: Schedule, built: Built) -> index.IndexRecord:
    """The index record of a kernel just built from ``schedule``."""
    ins = []
    for n in schedule.inputs:
        b = schedule.buffer(n)
        ins.append((b.value, b.layout, len(b.torch_shape)))
    (out_name,) = schedule.outputs
    ob = schedule.buffer(out_name)
    return index.IndexRecord(
        "kernel",
        function=schedule.name,
        request_name=built.request_name,
        cache_key=built.cache_key,
        binary_name=built.binary.name,
        suffix=built.source_path.suffix,
        inputs=tuple(ins),
        output=(ob.value, ob.layout, tuple(ob.torch_shape)),
    )


class IspcBackend(X86Backend):
    """ISPC per-tile kernels (``foreach`` over the contiguous dim) with OpenMP C glue over
    the tiles; available when a real ``ispc`` binary is on PATH."""

    name = "ispc"
    use_index = False  # the index records C kernels only

    def can_run(
        self,
        graph: Graph,
        nodes: Sequence[str],
        hardware: Hardware,
        options: Options | None = None,
    ) -> tuple[bool, str]:
        if shutil.which("ispc") is None:
            return False, "no ispc binary on PATH"
        ok, why = super().can_run(graph, nodes, hardware, options)
        if not ok:
            return ok, why
        try:
            with _SCHEDULE_LOCK:  # islpy's shared context, as in build()
                self.render(self.schedule(graph, nodes, hardware))
        except ValueError as e:
            return False, str(e)
        return True, ""

    def render(  # type: ignore[override]
        self, schedule: Schedule, hardware: Hardware | None = None
    ) -> tuple[str, str]:
        used = {
            x.fn
            for st in schedule.stages
            for e in (st.expr, *([st.reduction.body] if st.reduction else []))
            for x in _calls(e)
        }
        missing = sorted(used & set(UNSUPPORTED_ISPC))
        if missing:
            raise ValueError(f"ISPC has no {', '.join(missing)}")
        return render_ispc(schedule)

    def compile(self, schedule: Schedule, source, options: Options, hardware: Hardware) -> Built:  # type: ignore[override]  # noqa: ANN001
        ispc_source, glue = source
        return build_ispc(
            schedule.name,
            ispc_source,
            glue,
            Path(options.cache_dir),
            key_extra=(options.codegen_key(), hardware.key()),
        )


def _calls(expr: Any) -> list[Any]:
    if isinstance(expr, Call):
        return [expr] + [c for a in expr.args for c in _calls(a)]
    return []
