"""Compile generated C (or ISPC + C glue) into a shared library through the kernel cache.

``build_c`` and ``build_ispc`` are the only places the x86 fusion backend compiles: both
go through ``middleware.backends.cache`` (one folder per kernel, atomic writes, corrupt
binaries rebuilt) with the requests of ``backends/x86/build.py`` (whose key includes the
host CPU, since ``-march=native`` binaries are specific to one).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from ..cache import BuildRequest, kernel_cache
from .build import C_FLAGS, c_build_request, ispc_build_request

__all__ = ["C_FLAGS", "Built", "build_c", "build_ispc"]


@dataclasses.dataclass(frozen=True)
class Built:
    """A compiled kernel: the shared library and the source it was built from."""

    binary: Path
    source_path: Path
    compiled: bool
    command: tuple[str, ...]
    request_name: str = ""  # the cache request's name and key (for the group index)
    cache_key: str = ""


def _fill(command: tuple[str, ...], folder: Path, source: Path, binary: Path) -> tuple[str, ...]:
    subst = {"{src}": str(source), "{out}": str(binary), "{dir}": str(folder)}
    out = []
    for arg in command:
        for k, v in subst.items():
            arg = arg.replace(k, v)
        out.append(arg)
    return tuple(out)


def _build(req: BuildRequest, cache_dir: Path) -> Built:
    """Build ``req`` through the kernel cache and describe the result."""
    k = kernel_cache(Path(cache_dir)).build(req)
    return Built(
        k.binary,
        k.source_path,
        k.compiled,
        _fill(req.command, k.folder, k.source_path, k.binary),
        req.name,
        k.key,
    )


def build_c(
    name: str,
    source: str,
    cache_dir: Path,
    key_extra: tuple[str, ...] = (),
    meta: dict[str, Any] | None = None,
    flags: tuple[str, ...] = (),
) -> Built:
    """Compile ``source`` (or find it in the cache); raises CompileError with the compiler's
    stderr, the command and the source path. ``flags``: extra compiler flags (``-I``)."""
    req = c_build_request(name, source, meta=meta or {}, key_extra=key_extra, flags=flags)
    return _build(req, cache_dir)


def build_ispc(
    name: str,
    ispc_source: str,
    glue_source: str,
    cache_dir: Path,
    key_extra: tuple[str, ...] = (),
    meta: dict[str, Any] | None = None,
) -> Built:
    """Compile an ISPC kernel and its OpenMP C glue into one shared library (two steps)."""
    req = ispc_build_request(name, ispc_source, glue_source, meta=meta or {}, key_extra=key_extra)
    return _build(req, cache_dir)
