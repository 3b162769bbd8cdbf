"""Stand-in for the shared kernel cache (``backends/cache.py``) where that module is absent:
the same request record and folder layout (``<root>/kernels/<name>-<key[:16]>/``), no
metadata, no verification, no locking. Used only until the cache module is merged."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ...errors import CompileError


@dataclasses.dataclass(frozen=True)
class BuildRequest:
    name: str
    source: str
    suffix: str
    command: tuple[str, ...]
    binary_name: str
    compiler: str
    key_extra: tuple[str, ...] = ()
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict, hash=False)
    steps: tuple[tuple[str, ...], ...] = ()
    extra_files: tuple[tuple[str, str], ...] = ()


def build(req: BuildRequest, root: Path) -> Path:
    """Compile ``req`` into its folder under ``root`` unless its binary is there."""
    text = repr((req.source, req.command, req.steps, req.extra_files, req.key_extra))
    key = hashlib.sha256(text.encode()).hexdigest()
    folder = Path(root) / "kernels" / f"{req.name[:80]}-{key[:16]}"
    binary = folder / req.binary_name
    if binary.is_file():
        return binary
    folder.mkdir(parents=True, exist_ok=True)
    src = folder / ("kernel" + req.suffix)
    src.write_text(req.source)
    for fname, text in req.extra_files:
        (folder / fname).write_text(text)
    tmp = folder / f".{req.binary_name}.{os.getpid()}.tmp"
    for template in (req.command, *req.steps):
        cmd = [
            a.replace("{src}", str(src)).replace("{out}", str(tmp)).replace("{dir}", str(folder))
            for a in template
        ]
        proc = subprocess.run(cmd, cwd=folder, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise CompileError(
                f"{cmd[0]} exited with status {proc.returncode}",
                stderr=proc.stderr + proc.stdout,
                command=cmd,
                source_path=str(src),
            )
    os.replace(tmp, binary)
    return binary
