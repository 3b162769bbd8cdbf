"""The small enums the records of every stage share (core: imports nothing of the package).

Both are ``str`` enums: a member compares, hashes and formats as its value, so reports and
tests that compare against ``"io"`` or ``"generated"`` keep working.
"""

from __future__ import annotations

import enum


class Bound(str, enum.Enum):
    """What limits a node: activation traffic, weight traffic, or arithmetic."""

    IO = "io"
    PARAM = "param"
    COMPUTE = "compute"

    def __str__(self) -> str:
        return self.value


class RunsAs(str, enum.Enum):
    """How a step of a plan runs: a generated kernel (a fused I/O-bound group), a vendor or
    framework call (the catalogue's ATen implementation, oneDNN/cuDNN, Winograd), or the
    original framework callable of a node the middleware could not lower (fallback)."""

    GENERATED = "generated"
    VENDOR = "vendor"
    FALLBACK = "fallback"

    def __str__(self) -> str:
        return self.value
