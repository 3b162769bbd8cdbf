"""Build requests for the x86 backend (OpenMP C through the system C compiler, ISPC when a
real ``ispc`` binary is on PATH) and loading of the resulting shared libraries.

The requests go through :mod:`middleware.backends.cache`; nothing here compiles by itself.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import platform
import shutil
import subprocess
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ...errors import CompileError
from ..cache import BuildRequest, compiler_version

C_FLAGS: tuple[str, ...] = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
ISPC_FLAGS: tuple[str, ...] = ("-O3", "--pic")
ISPC_OBJECT = "kernel_ispc.o"
ISPC_HEADER = "kernel_ispc.h"
ISPC_GLUE = "glue.c"


def c_compiler(cc: str | None = None) -> str:
    """The C compiler to use: ``cc`` when given (a name on PATH or a path), else the first of
    ``cc`` and ``gcc`` found on PATH. Raises :class:`CompileError` when none is found.

    The caller decides (e.g. from an option read once at ``optimize()`` time); no environment
    variable is read here.
    """
    candidates = (cc,) if cc else ("cc", "gcc")
    for name in candidates:
        if shutil.which(name):
            return name
    raise CompileError(
        f"no C compiler found on PATH (looked for {', '.join(candidates)})",
        command=list(candidates[:1]),
    )


@functools.cache
def host_id() -> str:
    """What of this machine changes a ``-march=native`` binary: the architecture, the CPU
    model and a hash of its feature flags (so a cache shared between hosts never hands one
    host another's binary)."""
    model, flags = "", ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                field, _, value = line.partition(":")
                field = field.strip()
                if field == "model name" and not model:
                    model = value.strip()
                elif field in ("flags", "Features") and not flags:
                    flags = value.strip()
                if model and flags:
                    break
    except OSError:
        pass
    digest = hashlib.sha256(flags.encode()).hexdigest()[:12]
    return f"{platform.machine()}|{model or platform.processor()}|{digest}"


def c_build_request(
    name: str,
    source: str,
    meta: Mapping[str, Any] | None = None,
    key_extra: tuple[str, ...] = (),
    cc: str | None = None,
    flags: tuple[str, ...] = (),
) -> BuildRequest:
    """A request compiling OpenMP C ``source`` into ``kernel.so`` with
    ``<cc> -O3 -march=native -fopenmp -shared -fPIC <flags> -o {out} {src} -lm``.

    ``key_extra`` should carry the options that changed the source (``codegen_key()``); the
    host's CPU (:func:`host_id`) is added because of ``-march=native``.
    """
    compiler = c_compiler(cc)
    return BuildRequest(
        name=name,
        source=source,
        suffix=".c",
        command=(compiler, *C_FLAGS, *flags, "-o", "{out}", "{src}", "-lm"),
        binary_name="kernel.so",
        compiler=compiler,
        key_extra=(*key_extra, host_id()),
        meta=dict(meta or {}),
    )


@functools.cache
def ispc_available() -> tuple[bool, str]:
    """(True, version) when a working ``ispc`` binary is on PATH, else (False, why not).

    The PyPI package named ``ispc`` is an empty placeholder: only a binary that answers
    ``--version`` as the Intel SPMD Program Compiler counts.
    """
    path = shutil.which("ispc")
    if path is None:
        return False, "no ispc binary on PATH"
    try:
        proc = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return False, f"{path} cannot run: {exc}"
    text = (proc.stdout + proc.stderr).strip()
    if proc.returncode != 0 or "spmd" not in text.lower():
        return False, f"{path} is not the Intel SPMD Program Compiler ({text[:80]!r})"
    return True, text.splitlines()[0]


def ispc_build_request(
    name: str,
    source: str,
    c_glue_source: str,
    meta: Mapping[str, Any] | None = None,
    key_extra: tuple[str, ...] = (),
    cc: str | None = None,
    ispc: str = "ispc",
) -> BuildRequest:
    """A request compiling ISPC ``source`` to an object (and the header ``kernel_ispc.h``),
    then linking it with ``c_glue_source`` (saved as ``glue.c``; it may ``#include
    "kernel_ispc.h"``) into ``kernel.so``:

    ``ispc -O3 --pic -o {dir}/kernel_ispc.o -h {dir}/kernel_ispc.h {src}``, then
    ``<cc> -O3 -march=native -fopenmp -shared -fPIC -I{dir} -o {out} {dir}/glue.c
    {dir}/kernel_ispc.o -lm``.

    Check :func:`ispc_available` first; building without ispc raises :class:`CompileError`.
    """
    compiler = c_compiler(cc)
    return BuildRequest(
        name=name,
        source=source,
        suffix=".ispc",
        command=(
            ispc,
            *ISPC_FLAGS,
            "-o",
            f"{{dir}}/{ISPC_OBJECT}",
            "-h",
            f"{{dir}}/{ISPC_HEADER}",
            "{src}",
        ),
        binary_name="kernel.so",
        compiler=ispc,
        key_extra=(*key_extra, host_id(), f"cc={compiler_version(compiler)}"),
        meta=dict(meta or {}),
        steps=(
            (
                compiler,
                *C_FLAGS,
                "-I{dir}",
                "-o",
                "{out}",
                f"{{dir}}/{ISPC_GLUE}",
                f"{{dir}}/{ISPC_OBJECT}",
                "-lm",
            ),
        ),
        extra_files=((ISPC_GLUE, c_glue_source),),
    )


_loaded: dict[str, ctypes.CDLL] = {}
_loaded_lock = threading.Lock()


def load_shared(path: Path | str) -> ctypes.CDLL:
    """The shared library at ``path`` loaded with ctypes, once per path per process.

    (The dynamic loader keeps a library loaded under its path; a cache binary never changes
    under a given key, so loading once is safe.)
    """
    resolved = str(Path(path).resolve())
    with _loaded_lock:
        lib = _loaded.get(resolved)
        if lib is None:
            lib = _loaded[resolved] = ctypes.CDLL(resolved)
        return lib
