"""The pipeline's :class:`~middleware.backends.interface.Backend` for CUDA devices.

A thin wrapper over the CUDA backend's stages: ``lower.py`` (batch norms as multiply-add,
channels_last weights), ``units.cuda_units`` (generated kernels for io groups, cuDNN/cuBLAS
through PyTorch for the rest) and ``graphs.CudaGraphPlan`` (the plan replayed as one CUDA
graph, captured here when the example inputs are on the device).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ...graph import Graph
from ...hardware import Hardware
from ...options import Options
from ...passes import DECOMPOSITIONS
from ..interface import Unit
from . import check_cuda_runtime
from .graphs import CudaGraphPlan
from .lower import affine_batch_norms, channels_last_weights
from .units import cuda_units, why_unsupported


class CudaBackend:
    """CUDA C kernels for io groups (NVRTC or nvcc, loaded through pycuda/cuda-python),
    cuDNN/cuBLAS through PyTorch for convolutions and matrix products."""

    name = "cuda"
    device_type = "cuda"
    # "auto" batch slicing stays off: the slices' kernels would be too small to fill the
    # GPU (and it is not measured there); a number of samples per slice still slices.
    slices_batch = False

    def check_runtime(self) -> None:
        """A CUDA device and a kernel loader (pycuda or cuda-python) must be present."""
        check_cuda_runtime()

    def can_run(
        self,
        graph: Graph,
        nodes: Sequence[str],
        hardware: Hardware,
        options: Options | None = None,
    ) -> tuple[bool, str]:
        """Whether every node of the group has a CUDA rendering; when not, why."""
        reason = why_unsupported(graph, list(nodes), hardware)
        return not reason, reason

    def passes_off(self, options: Options) -> tuple[str, ...]:
        """``cuda_weights="share"``: batch norms stay unfolded (a folded weight is a copy).
        LayerNorm and softmax stay ATen's calls: the reductions of their
        decompositions (``passes.DECOMPOSITIONS``) were never measured on a GPU."""
        off = DECOMPOSITIONS
        return (*off, "fold_batchnorm") if options.cuda_weights == "share" else off

    def lower(self, graph: Graph, options: Options) -> Graph:
        """Batch norms as a per-channel multiply-add; convolution weights channels_last
        unless the plan shares the model's weights (``cuda_weights="share"``)."""
        graph = affine_batch_norms(graph)
        return graph if options.cuda_weights == "share" else channels_last_weights(graph)

    def units(
        self, graph: Graph, options: Options, hardware: Hardware, device: torch.device
    ) -> list[Unit]:
        return cuda_units(graph, options, hardware, device)

    def finish(self, plan: Any, options: Options, inputs: Sequence[torch.Tensor] | None) -> Any:
        """With ``options.cuda_graphs``, the plan replays as one CUDA graph: captured here on
        ``inputs`` when they are CUDA tensors (so that the report says whether it could be),
        else on its first call; with "auto" (the default) only where replay measured faster
        than running step by step."""
        if not options.cuda_graphs:
            return plan
        graphed = CudaGraphPlan(plan, decide=options.cuda_graphs == "auto")
        if inputs is not None and all(x.device.type == "cuda" for x in inputs):
            with torch.no_grad():
                graphed.capture(inputs)
        return graphed
