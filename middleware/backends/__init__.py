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


def _x86() -> object:
    from .x86.backend import X86Backend

    return X86Backend()


def _ispc() -> object:
    from .x86.backend import IspcBackend

    return IspcBackend()


# Fusion backends by name: each entry makes the backend object (imported when asked for).
BACKENDS = {"x86": _x86, "ispc": _ispc}


def get_backend(name: str) -> object:
    """The fusion backend called ``name``; an unknown name fails listing what exists."""
    try:
        make = BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"unknown backend {name!r}; backends are: {', '.join(sorted(BACKENDS))}"
        ) from None
    return make()
