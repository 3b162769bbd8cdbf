"""NVRTC as a compile command, for machines with cuda-python but without nvcc.

``python -m middleware.backends.cuda.nvrtc sm_90 kernel.cu kernel.cubin`` compiles a
generated kernel to a cubin with the same flags as nvcc (``-O3``-equivalent defaults, no
fast math), so that the kernel cache treats it like any other compiler command.
"""

from __future__ import annotations

import sys
from pathlib import Path

# NVRTC compiles device code only, at full optimisation by default; C++17 as with nvcc.
NVRTC_FLAGS = ("-std=c++17", "-default-device")


def compile_cubin(source: str, arch: str, name: str = "kernel.cu") -> bytes:
    """The cubin of ``source`` for ``arch`` (e.g. "sm_90"); raises RuntimeError with the log."""
    from cuda.bindings import nvrtc

    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], [])
    _check(err, "nvrtcCreateProgram")
    try:
        opts = [f"--gpu-architecture={arch}".encode(), *(o.encode() for o in NVRTC_FLAGS)]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if int(err) != 0:
            _, size = nvrtc.nvrtcGetProgramLogSize(prog)
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC failed for {arch}:\n{log.decode(errors='replace')}")
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        _check(err, "nvrtcGetCUBINSize")
        cubin = b" " * size
        (err,) = nvrtc.nvrtcGetCUBIN(prog, cubin)
        _check(err, "nvrtcGetCUBIN")
        return cubin
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _check(err: object, what: str) -> None:
    if int(err) != 0:  # type: ignore[call-overload]
        raise RuntimeError(f"{what} failed: {err}")


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: python -m middleware.backends.cuda.nvrtc ARCH SRC OUT", file=sys.stderr)
        return 2
    arch, src, out = argv
    try:
        cubin = compile_cubin(Path(src).read_text(), arch, Path(src).name)
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    Path(out).write_bytes(cubin)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
