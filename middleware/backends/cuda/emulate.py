"""Run a generated CUDA kernel on the CPU: the same source compiled as C++ with
``emulate.h`` (g++, through the kernel cache) and called with ctypes over CPU tensors.

This is how the CUDA backend is tested where there is no GPU (CI): the launch goes
through the same :class:`~.kernel.GeneratedKernel` wrapper as on the GPU, only the
launcher differs.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path

from .build import build, emulation_request
from .render import RenderedKernel


class EmulatedLauncher:
    """``launch(grid, block, ptrs)`` running kernel ``name``'s grid on the CPU, from a
    library built with ``emulate.h`` (:func:`emulated_launcher` builds one)."""

    def __init__(self, library: Path, name: str) -> None:
        self.library_path = Path(library)
        self._lib = ctypes.CDLL(str(self.library_path))
        self._fn = getattr(self._lib, f"mw_emulate_{name}")
        self._fn.argtypes = (ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint, ctypes.c_uint)
        self._fn.restype = None

    def launch(self, grid: int, block: int, ptrs: Sequence[int]) -> None:
        arr = (ctypes.c_void_p * len(ptrs))(*ptrs)
        self._fn(arr, grid, block)


def emulated_launcher(rendered: RenderedKernel, cache_dir: Path) -> EmulatedLauncher:
    """Compile ``rendered`` for the CPU emulation (through the kernel cache) and load it."""
    req = emulation_request(rendered.name, rendered.source, {"group": rendered.schedule.name})
    return EmulatedLauncher(build(req, cache_dir), rendered.name)
