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
    """``launch(grid, block, ptrs)`` running the kernel's grid on the CPU."""

    def __init__(self, rendered: RenderedKernel, cache_dir: Path) -> None:
        req = emulation_request(rendered.name, rendered.source, {"group": rendered.group.name})
        self.library_path = build(req, cache_dir)
        self._lib = ctypes.CDLL(str(self.library_path))
        self._fn = getattr(self._lib, f"mw_emulate_{rendered.name}")
        self._fn.argtypes = (ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint, ctypes.c_uint)
        self._fn.restype = None

    def launch(self, grid: int, block: int, ptrs: Sequence[int]) -> None:
        arr = (ctypes.c_void_p * len(ptrs))(*ptrs)
        self._fn(arr, grid, block)
