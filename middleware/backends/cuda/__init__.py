"""CUDA backend: depth-first kernels in CUDA C, cuDNN/cuBLAS via PyTorch.

Stages: the passes' groups and schedules (``passes/group.py``, ``passes/schedule.py``) ->
``render.py`` (jinja2 template: one thread per output, element functions from the
schedule's loop semantics, spelled with ``funcs.CUDA_FUNCS``) -> ``build.py`` (nvcc or
NVRTC into the kernel cache) -> ``loader.py`` (pycuda or cuda.bindings) -> ``kernel.py``
(a callable over torch tensors); ``units.py`` puts them in the plan with cuDNN/cuBLAS and
the convolution epilogues (``epilogue.py``).
``emulate.h``/``emulate.py`` run the same generated source on the CPU for tests.
"""

from __future__ import annotations

import torch

from ...errors import DeviceError
from .loader import INSTALL_HINT, available_loaders


def check_cuda_runtime() -> None:
    """Raise ``DeviceError`` naming the missing piece when generated CUDA kernels cannot run:
    no CUDA device, or no kernel loader (pycuda or cuda-python), with how to install it."""
    if not torch.cuda.is_available():
        raise DeviceError(
            "device='cuda' but PyTorch sees no CUDA device here (torch.cuda.is_available() is "
            "False: no GPU, no driver, or a CPU-only PyTorch build)"
        )
    if not available_loaders():
        raise DeviceError(
            "device='cuda' needs a CUDA kernel loader to run generated kernels, and neither "
            f"pycuda nor cuda-python (cuda.bindings) is importable here; {INSTALL_HINT}"
        )
