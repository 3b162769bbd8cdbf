"""Backends: render schedules to code, compile it into the kernel cache, and map
compute-bound groups onto vendor libraries. Each backend answers one small interface."""

from __future__ import annotations

import shutil


def describe_available() -> list[str]:
    """One line per device that can run here, naming the code generators found."""
    import torch

    x86 = (
        "cpu (OpenMP C"
        + (", ISPC" if shutil.which("ispc") else "")
        + "; vendor: oneDNN via PyTorch)"
    )
    out = [x86]
    if torch.cuda.is_available():
        out.append("cuda (CUDA C; vendor: cuDNN/cuBLAS via PyTorch)")
    return out
