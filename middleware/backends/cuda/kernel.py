"""A generated CUDA kernel as a callable over framework tensors, and the backend's entry
points: render -> compile -> load for one schedule (``passes/schedule.py``).

Buffers: outputs are allocated with ``torch.empty`` on the inputs' device in the layout the
graph gives them (channels_last for "nhwc"), so PyTorch's caching allocator owns every byte.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from ...graph import TensorType
from ...hardware import Hardware
from ...passes.schedule_ir import Schedule
from .build import build, cubin_request
from .emulate import emulated_launcher
from .loader import LoadedKernel, get_loader
from .render import RenderedKernel, render_schedule

_F32 = torch.float32


class Launcher(Protocol):
    def launch(self, grid: int, block: int, ptrs: Sequence[int]) -> None: ...


def memory_format_of(t: TensorType) -> torch.memory_format:
    """The PyTorch memory format a value of type ``t`` is stored in."""
    return torch.channels_last if t.rank == 4 and t.layout == "nhwc" else torch.contiguous_format


def _dense(x: torch.Tensor, size: torch.Size, fmt: torch.memory_format) -> torch.Tensor:
    """``x`` laid out as the kernel reads it (a copy only when it is not already)."""
    if x.shape != size:
        raise ValueError(f"kernel input has shape {tuple(x.shape)}, expected {tuple(size)}")
    if x.dtype != torch.float32:
        raise TypeError(f"kernel input is {x.dtype}, generated CUDA kernels take float32")
    return x if x.is_contiguous(memory_format=fmt) else x.contiguous(memory_format=fmt)


def _strides(size: torch.Size, fmt: torch.memory_format) -> tuple[int, ...]:
    return torch.empty(size, device="meta", memory_format=fmt).stride()


class GeneratedKernel:
    """``kernel(*inputs)`` returns the group's output(s); ``kernel.out(*inputs, *outputs)``
    writes into preallocated outputs (the destination-passing form). Outputs must not
    alias inputs: a thread reads neighbouring input elements (windows) of what it writes.

    Every input is checked at every call (float32, the shape, the layout the kernel reads:
    a copy where it is not) except the plan's own constants, which the plan names once
    (:meth:`constant_inputs`) and which are checked then."""

    def __init__(self, rendered: RenderedKernel, launcher: Launcher) -> None:
        self.rendered = rendered
        self.launcher = launcher
        self.name = rendered.name
        self._n_in = len(rendered.inputs)
        self._grid, self._block = rendered.launch.grid, rendered.launch.block
        self._ins = [(torch.Size(t.shape), memory_format_of(t)) for t in rendered.in_types]
        # per input: (size, memory format, the plan's constant at that position or None)
        self._checks = [(size, fmt, None) for size, fmt in self._ins]
        self._outs = [(torch.Size(t.shape), memory_format_of(t)) for t in rendered.out_types]
        self._single = self._outs[0] if len(self._outs) == 1 else None
        # the single output's (size, strides): torch.empty_strided parses fewer arguments
        # than torch.empty(..., memory_format=...)
        self._single_strided = (
            (self._single[0], _strides(*self._single)) if self._single is not None else None
        )

    @property
    def launcher(self) -> Launcher:
        return self._launcher

    @launcher.setter
    def launcher(self, launcher: Launcher) -> None:
        # the bound launch taken once (no attribute lookups per call); replacing the
        # launcher replaces it
        self._launcher = launcher
        self._launch = launcher.launch

    def constant_inputs(self, constants: dict[int, torch.Tensor]) -> None:
        """The plan's constants by input position: tensors only the plan holds, passed at
        every call as the same objects. Each one that the kernel reads as it is (float32,
        the shape, the layout) is checked here, once: at a call, an input that *is* that
        object skips the checks (any other tensor at that position is checked as before)."""
        checks = []
        for i, (size, fmt) in enumerate(self._ins):
            c = constants.get(i)
            if c is not None and not (
                c.dtype is _F32 and c.shape == size and c.is_contiguous(memory_format=fmt)
            ):
                c = None  # checked (and laid out) at every call, as any input
            checks.append((size, fmt, c))
        self._checks = checks

    def __call__(self, *inputs: torch.Tensor) -> Any:
        single = self._single_strided
        if single is not None and len(inputs) == self._n_in and inputs:
            # the common case (one output, inputs already laid out as the kernel reads
            # them): the fewest Python operations between the call and the launch, since a
            # step-by-step plan on a GPU is bound by this host time on small kernels
            ptrs = []
            for x, (size, fmt, const) in zip(inputs, self._checks, strict=True):
                if x is not const and (
                    x.dtype is not _F32 or x.shape != size or not x.is_contiguous(memory_format=fmt)
                ):
                    break
                ptrs.append(x.data_ptr())
            else:
                size, strides = single
                out = torch.empty_strided(size, strides, dtype=_F32, device=inputs[0].device)
                ptrs.append(out.data_ptr())
                self._launch(self._grid, self._block, ptrs)
                return out
        dev = inputs[0].device if inputs else torch.device("cpu")
        outs = [
            torch.empty(size, dtype=torch.float32, device=dev, memory_format=fmt)
            for size, fmt in self._outs
        ]
        self.out(*inputs, *outs)
        return outs[0] if single is not None else tuple(outs)

    def out(self, *args: torch.Tensor) -> None:
        n = self._n_in
        if len(args) == n + len(self._outs):
            # the common case (inputs and outputs as the kernel reads and writes them): no
            # copies, no staging
            ptrs = []
            for x, (size, fmt, const) in zip(args, self._checks, strict=False):  # the inputs
                if x is not const and (
                    x.dtype is not _F32 or x.shape != size or not x.is_contiguous(memory_format=fmt)
                ):
                    break
                ptrs.append(x.data_ptr())
            else:
                for o, (size, fmt) in zip(args[n:], self._outs, strict=True):
                    if o.shape != size or not o.is_contiguous(memory_format=fmt):
                        break
                    ptrs.append(o.data_ptr())
                else:
                    self._launch(self._grid, self._block, ptrs)
                    return
        # the laid-out inputs stay referenced until the launch is queued (a copy made here
        # must not be freed before; on CUDA the caching allocator orders the reuse by stream)
        ins = [
            x
            if x is const
            or (x.dtype is _F32 and x.shape == size and x.is_contiguous(memory_format=fmt))
            else _dense(x, size, fmt)
            for x, (size, fmt, const) in zip(args[:n], self._checks, strict=True)
        ]
        ptrs = [x.data_ptr() for x in ins]
        staged = []
        for o, (size, fmt) in zip(args[n:], self._outs, strict=True):
            if o.shape != size or not o.is_contiguous(memory_format=fmt):
                tmp = torch.empty(size, dtype=torch.float32, device=o.device, memory_format=fmt)
                staged.append((o, tmp))
                o = tmp
            ptrs.append(o.data_ptr())
        self._launch(self._grid, self._block, ptrs)
        for dst, tmp in staged:
            dst.copy_(tmp)


def compile_schedule(
    schedule: Schedule,
    hardware: Hardware,
    cache_dir: Path,
    device: int = 0,
    key_extra: tuple[str, ...] = (),
    loader: str | None = None,
) -> GeneratedKernel:
    """Render ``schedule``, compile it for ``hardware.arch`` through the kernel cache, load
    it with pycuda or cuda.bindings on ``device``; a callable over CUDA tensors.

    Raises ``UnsupportedError`` (cannot render), ``CompileError`` (nvcc/NVRTC failed) or
    ``DeviceError`` (no compiler or loader).
    """
    rendered = render_schedule(schedule, hardware, emulate=False)
    req = cubin_request(
        rendered.name, rendered.source, hardware.arch or "sm_80", key_extra, meta=_meta(rendered)
    )
    cubin = build(req, cache_dir).read_bytes()
    launcher = LoadedKernel(cubin, rendered.name, device, get_loader(loader))
    return GeneratedKernel(rendered, launcher)


def emulate_schedule(schedule: Schedule, hardware: Hardware, cache_dir: Path) -> GeneratedKernel:
    """The same kernel compiled for the CPU emulation: a callable over CPU tensors."""
    rendered = render_schedule(schedule, hardware, emulate=True)
    return GeneratedKernel(rendered, emulated_launcher(rendered, cache_dir))


def _meta(r: RenderedKernel) -> dict[str, Any]:
    return {
        "group": r.schedule.name,
        "layers": list(r.schedule.layers),
        "shapes": {
            v: str(t) for v, t in zip(r.inputs + r.outputs, r.in_types + r.out_types, strict=True)
        },
        "grid": r.launch.grid,
        "block": r.launch.block,
    }
