"""Compile generated C into a shared library through the kernel cache.

``build_c`` is the one place the x86 fusion backend compiles: it uses the kernel cache
(``middleware.backends.cache``, one folder per kernel, atomic writes) when that module is
present, else a minimal equivalent (same folder layout, same flags) so that this backend
works on its own. Switching entirely to the cache is the one call in ``build_c``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from ...errors import CompileError

C_FLAGS: tuple[str, ...] = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")


@dataclasses.dataclass(frozen=True)
class Built:
    """A compiled kernel: the shared library and the source it was built from."""

    binary: Path
    source_path: Path
    compiled: bool
    command: tuple[str, ...]


def c_compiler() -> str:
    for name in ("cc", "gcc"):
        if shutil.which(name):
            return name
    raise CompileError("no C compiler found on PATH (looked for cc, gcc)", command=["cc"])


def c_command(cc: str) -> tuple[str, ...]:
    return (cc, *C_FLAGS, "-o", "{out}", "{src}", "-lm")


def build_c(
    name: str,
    source: str,
    cache_dir: Path,
    key_extra: tuple[str, ...] = (),
    meta: dict[str, Any] | None = None,
) -> Built:
    """Compile ``source`` (or find it in the cache); raises CompileError with the compiler's
    stderr, the command and the source path."""
    cc = c_compiler()
    command = c_command(cc)
    try:
        from ..cache import BuildRequest, kernel_cache  # the shared kernel cache
    except ImportError:
        return _build_minimal(name, source, Path(cache_dir), command, key_extra)
    req = BuildRequest(
        name=name,
        source=source,
        suffix=".c",
        command=command,
        binary_name="kernel.so",
        compiler=cc,
        key_extra=key_extra,
        meta=meta or {},
    )
    k = kernel_cache(Path(cache_dir)).build(req)
    return Built(k.binary, k.source_path, k.compiled, command)


def _build_minimal(
    name: str, source: str, root: Path, command: tuple[str, ...], key_extra: tuple[str, ...]
) -> Built:
    version = subprocess.run(
        [command[0], "--version"], capture_output=True, text=True, check=False
    ).stdout.splitlines()[:1]
    h = hashlib.sha256("\0".join([source, *command, *version, *key_extra]).encode()).hexdigest()
    folder = root / "kernels" / f"{name}-{h[:16]}"
    folder.mkdir(parents=True, exist_ok=True)
    src, out = folder / "kernel.c", folder / "kernel.so"
    cmd = [c.replace("{src}", str(src)).replace("{out}", str(out)) for c in command]
    if out.exists() and src.exists():
        return Built(out, src, False, tuple(cmd))
    tmp_src = folder / f".kernel.{os.getpid()}.c"
    tmp_src.write_text(source)
    os.replace(tmp_src, src)
    tmp_out = folder / f".kernel.{os.getpid()}.so"
    run = [c.replace(str(out), str(tmp_out)) for c in cmd]
    t0 = time.perf_counter()
    r = subprocess.run(run, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise CompileError(
            f"compiling {name} failed", stderr=r.stderr, command=cmd, source_path=str(src)
        )
    os.replace(tmp_out, out)
    del t0
    return Built(out, src, True, tuple(cmd))


def build_ispc(
    name: str, ispc_source: str, glue_source: str, cache_dir: Path, key_extra: tuple[str, ...] = ()
) -> Built:
    """Compile an ISPC kernel and its OpenMP C glue into ``kernel.so`` (two steps, one
    folder per kernel under ``cache_dir/kernels``, keyed like ``build_c``)."""
    ispc = shutil.which("ispc")
    if ispc is None:
        raise CompileError("no ispc binary on PATH", command=["ispc"])
    cc = c_compiler()
    steps = (
        ("ispc", "-O3", "--pic", "--target=host", "-o", "{dir}/kernel_ispc.o", "{src}"),
        (cc, *C_FLAGS, "-o", "{out}", "{dir}/glue.c", "{dir}/kernel_ispc.o", "-lm"),
    )
    text = "\0".join([ispc_source, glue_source, *(" ".join(s) for s in steps), *key_extra])
    h = hashlib.sha256(text.encode()).hexdigest()
    folder = Path(cache_dir) / "kernels" / f"{name}-ispc-{h[:16]}"
    folder.mkdir(parents=True, exist_ok=True)
    src, out = folder / "kernel.ispc", folder / "kernel.so"
    subst = {"{src}": str(src), "{out}": str(out), "{dir}": str(folder)}

    def fill(arg: str) -> str:
        for k, v in subst.items():
            arg = arg.replace(k, v)
        return arg

    if out.exists():
        return Built(out, src, False, tuple(fill(a) for a in steps[0]))
    for fname, text in (("kernel.ispc", ispc_source), ("glue.c", glue_source)):
        tmp = folder / f".{fname}.{os.getpid()}"
        tmp.write_text(text)
        os.replace(tmp, folder / fname)
    for step in steps:
        cmd = [fill(a) for a in step]
        r = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if r.returncode != 0:
            raise CompileError(
                f"compiling {name} (ISPC) failed",
                stderr=r.stderr,
                command=cmd,
                source_path=str(src),
            )
    return Built(out, src, True, tuple(fill(a) for a in steps[0]))
