"""Backends: render schedules to code, compile it into the kernel cache, and map
compute-bound groups onto vendor libraries. Each backend answers one small interface
(``interface.Backend``); the pipeline asks this registry for the backend of its device.

Backends are registered by name with the module that defines them, imported when first
asked for (the CUDA backend pulls in its loaders and templates only on CUDA).
"""

from __future__ import annotations

import importlib
import shutil
from collections.abc import Callable

import torch

from .interface import Backend, Unit, node_step, node_unit, to_tensor

__all__ = [
    "BACKENDS",
    "Backend",
    "Unit",
    "backend_for",
    "describe_available",
    "get_backend",
    "node_step",
    "node_unit",
    "register_backend",
    "to_tensor",
]


def describe_available() -> list[str]:
    """One line per device that can run here, naming the code generators found."""
    x86 = (
        "cpu (OpenMP C"
        + (", ISPC" if shutil.which("ispc") else "")
        + "; vendor: oneDNN via PyTorch)"
    )
    out = [x86]
    if torch.cuda.is_available():
        out.append("cuda (CUDA C; vendor: cuDNN/cuBLAS via PyTorch)")
    return out


def _lazy(module: str, cls: str) -> Callable[[], Backend]:
    """A factory that imports ``module`` (relative to this package) when first called."""

    def make() -> Backend:
        return getattr(importlib.import_module(module, __name__), cls)()

    make.__qualname__ = f"{module}.{cls}"
    return make


# Backends by name: each entry makes the backend object. "reference" interprets schedules
# in Python/numpy (backends/reference/, the golden model of the tests; no device default).
# Further backends register through register_backend.
BACKENDS: dict[str, Callable[[], Backend]] = {
    "x86": _lazy(".cpu.backend", "CpuBackend"),
    "ispc": _lazy(".cpu.backend", "IspcCpuBackend"),
    "cuda": _lazy(".cuda.backend", "CudaBackend"),
    "reference": _lazy(".reference.backend", "ReferenceBackend"),
}

# The backend each device type runs on unless asked otherwise.
DEVICE_DEFAULTS: dict[str, str] = {"cpu": "x86", "cuda": "cuda"}


def register_backend(
    name: str, make: Callable[[], Backend], device_type: str | None = None
) -> None:
    """Add (or replace) the backend ``name``; with ``device_type`` it becomes that device's
    default."""
    BACKENDS[name] = make
    if device_type is not None:
        DEVICE_DEFAULTS[device_type] = name


def get_backend(name: str) -> Backend:
    """The backend called ``name``; an unknown name fails listing what exists."""
    try:
        make = BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"unknown backend {name!r}; backends are: {', '.join(sorted(BACKENDS))}"
        ) from None
    return make()


def backend_for(device: torch.device | str) -> Backend:
    """The backend that runs plans on ``device`` ("cpu", "cuda:0", ...)."""
    kind = torch.device(device).type
    name = DEVICE_DEFAULTS.get(kind)
    if name is None:
        raise ValueError(
            f"no backend runs on device {kind!r}; devices are: {', '.join(sorted(DEVICE_DEFAULTS))}"
        )
    return get_backend(name)
