"""Compile generated CUDA C through the kernel cache: nvcc (or NVRTC) to a cubin for the
device's architecture, and g++ to a shared library for the CPU emulation.

Numerics: kernels are compiled with ``-O3`` and WITHOUT ``--use_fast_math``: fast math
swaps ``expf``/``erff``/division/``sqrtf`` for approximations that miss PyTorch's results at
the 1e-5 tolerance the tests hold (sigmoid, GELU, batch-norm). The kernels are memory-bound,
so the exact functions cost nothing measurable.

The cache key holds the source, the full command (so the architecture, ``-arch=sm_XX``), the
compiler's ``--version`` line (the CUDA version) and ``key_extra`` (architecture and the
options' codegen key again, and the NVRTC version when NVRTC compiles).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from ...errors import CompileError, DeviceError
from ..cache import BuildRequest, kernel_cache

EMULATE_H = Path(__file__).parent / "emulate.h"
NVCC_FLAGS = ("-O3", "-std=c++17")
EMULATE_FLAGS = ("-O1", "-std=c++17", "-shared", "-fPIC", "-fno-fast-math")


def find_nvcc() -> str | None:
    """The nvcc executable: on PATH, else the usual CUDA install folders."""
    found = shutil.which("nvcc")
    if found:
        return found
    for p in ("/usr/local/cuda/bin/nvcc", "/usr/local/bin/nvcc", "/opt/cuda/bin/nvcc"):
        if Path(p).is_file():
            return p
    return None


def nvrtc_available() -> bool:
    """Whether cuda-python's NVRTC binding and the NVRTC library load here."""
    try:
        from cuda.bindings import nvrtc

        err, *_ = nvrtc.nvrtcVersion()
        return int(err) == 0
    except Exception:  # noqa: BLE001 - any failure means: not available
        return False


def nvrtc_version() -> str:
    from cuda.bindings import nvrtc

    _, major, minor = nvrtc.nvrtcVersion()
    return f"nvrtc {major}.{minor}"


def check_arch(arch: str) -> str:
    """``arch`` as nvcc spells it (``sm_80``, ``sm_90``, ``sm_90a``)."""
    if not arch.startswith("sm_") or not arch[3:5].isdigit():
        raise DeviceError(f"not a CUDA architecture: {arch!r} (expected e.g. 'sm_90')")
    return arch


def cubin_request(
    name: str,
    source: str,
    arch: str,
    key_extra: tuple[str, ...] = (),
    meta: dict | None = None,
    compiler: str = "auto",
):  # noqa: ANN201
    """The :class:`BuildRequest` that compiles ``source`` to ``kernel.cubin`` for ``arch``.

    ``compiler``: "nvcc", "nvrtc" or "auto" (nvcc when found, else NVRTC through
    cuda-python). Raises ``DeviceError`` when neither is available.
    """
    arch = check_arch(arch)
    nvcc = find_nvcc() if compiler in ("auto", "nvcc") else None
    if nvcc is not None:
        command = (nvcc, "-cubin", f"-arch={arch}", *NVCC_FLAGS, "-o", "{out}", "{src}")
        exe, extra = nvcc, ()
    elif compiler in ("auto", "nvrtc") and nvrtc_available():
        command = (sys.executable, "-m", "middleware.backends.cuda.nvrtc", arch, "{src}", "{out}")
        exe, extra = sys.executable, (nvrtc_version(),)
    else:
        raise DeviceError(
            "no CUDA compiler: neither nvcc (CUDA toolkit) nor NVRTC (pip install cuda-python "
            "nvidia-cuda-nvrtc) is available"
        )
    return BuildRequest(
        name=name,
        source=source,
        suffix=".cu",
        command=command,
        binary_name="kernel.cubin",
        compiler=exe,
        key_extra=(arch, *extra, *key_extra),
        meta=dict(meta or {}),
    )


def emulation_request(name: str, source: str, meta: dict | None = None):  # noqa: ANN201
    """The :class:`BuildRequest` that compiles ``source`` as C++ for the CPU emulation
    (``emulate.h`` is written beside the source and is part of the key)."""
    cxx = shutil.which("g++") or shutil.which("c++") or "g++"
    command = (
        cxx,
        "-x",
        "c++",
        *EMULATE_FLAGS,
        "-DMW_EMULATE",
        "-include",
        "{dir}/emulate.h",
        "-o",
        "{out}",
        "{src}",
    )
    return BuildRequest(
        name=name + "_emu",
        source=source,
        suffix=".cu",
        command=command,
        binary_name="kernel_emu.so",
        compiler=cxx,
        key_extra=("cpu-emulation",),
        meta=dict(meta or {}),
        extra_files=(("emulate.h", EMULATE_H.read_text()),),
    )


def build(request: BuildRequest, cache_dir: Path) -> Path:
    """Compile ``request`` through the kernel cache under ``cache_dir``; the binary's path.

    Raises :class:`CompileError` with the compiler's output, command and source path.
    """
    return kernel_cache(Path(cache_dir)).build(request).binary


def build_many(requests: list[BuildRequest], cache_dir: Path) -> list[Path | CompileError]:
    """Build every request (misses in parallel through the cache); a binary path or the
    :class:`CompileError` of each, in order."""
    results = kernel_cache(Path(cache_dir)).build_many(requests)
    return [r if isinstance(r, CompileError) else r.binary for r in results]
