"""The pipeline's :class:`~middleware.backends.interface.Backend` for CPUs.

A CPU backend is a code generator of ``backends/x86`` (OpenMP C, or ISPC) for the
I/O-bound groups, plus the vendor module's algorithms (oneDNN, Winograd) and the framework
for the rest (``units.cpu_units``). No CPU-specific lowering, nothing to add to the plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ...graph import Graph
from ...hardware import Hardware
from ...options import Options
from ..interface import Unit
from ..vendor import onednn
from ..vendor.algorithms import AUTO, AUTOTUNE, DEFAULT
from ..x86.backend import IspcBackend, X86Backend
from .units import cpu_units


class CpuBackend(X86Backend):
    """OpenMP C kernels for io groups; oneDNN (prepacked, fused post-ops) and Winograd for
    convolutions and matrix products."""

    device_type = "cpu"
    slices_batch = True  # batch slicing pays on CPU caches (runtime/chunked.py)
    tunes_whole_plans = True  # pipeline.network_choice

    def check_runtime(self) -> None:
        """A CPU plan needs nothing beyond PyTorch (the C compiler is checked per kernel:
        a group that fails to compile runs through the framework)."""

    def passes_off(self, options: Options) -> tuple[str, ...]:
        """``fuse_depthwise`` where its layer would not run as the fused oneDNN primitive
        (no primitives: the reference's two ATen convolutions would replace two prepacked
        calls) or where the user named conv2d algorithms (one name for every layer, a list
        or a callable: each counts on the conv2d layers, two of which the pass would
        merge; ``fuse_stem`` then too). "auto" and "autotune" keep them: the middleware
        decides there. ``fuse_stem``'s layer is the generated direct kernel's: no oneDNN;
        it is off under ``max_extra_param_bytes`` too."""
        chosen = any(
            op == "conv2d" and sel not in (DEFAULT, AUTO, AUTOTUNE)
            for op, sel in options.algorithms
        )
        if chosen:
            return ("fuse_depthwise", "fuse_stem")
        off: tuple[str, ...] = ()
        if not options.onednn_primitives or onednn.unavailable(options):
            off += ("fuse_depthwise",)
        if options.max_extra_param_bytes is not None:
            # a cap the fused stem kernel's packed weights could exceed: its layer would run
            # as the reference's two unpacked convolutions
            off += ("fuse_stem",)
        return off

    def lower(self, graph: Graph, options: Options) -> Graph:
        """No CPU-specific rewrites: the passes' graph is what runs."""
        return graph

    def units(
        self, graph: Graph, options: Options, hardware: Hardware, device: torch.device
    ) -> list[Unit]:
        """Generated kernels for the io groups, vendor calls for the rest (cpu_units)."""
        return cpu_units(self, graph, options, hardware, device)

    def finish(self, plan: Any, options: Options, inputs: Sequence[torch.Tensor] | None) -> Any:
        """A CPU plan runs as built."""
        return plan


class IspcCpuBackend(IspcBackend, CpuBackend):
    """:class:`CpuBackend` with ISPC kernels for the io groups (an ``ispc`` binary on PATH)."""
