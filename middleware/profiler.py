"""The built-in profiler: peak memory and latency of the original and the optimized model.

``profile(model, inputs)`` optimizes ``model`` (unless given its ``OptimizedModule``), runs
both side by side and returns a :class:`ProfileResult`; the measuring itself is
``runtime/profile.py``.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

from .api import optimize
from .runtime.profile import (
    PLAN_TOLERANCE,
    GroupProfile,
    LiveStorageTracker,
    ModelProfile,
    ProfileResult,
    measure,
    measure_peak,
    measure_training,
    plot_results,
)

__all__ = [
    "PLAN_TOLERANCE",
    "GroupProfile",
    "LiveStorageTracker",
    "ModelProfile",
    "ProfileResult",
    "measure_peak",
    "plot_results",
    "profile",
]


def profile(
    model: nn.Module,
    inputs: Sequence[torch.Tensor] | torch.Tensor,
    optimized: Any = None,
    repeats: int = 5,
    warmup: int = 1,
    train: bool = False,
    **options: Any,
) -> ProfileResult:
    """Measure ``model`` and its optimized form on ``inputs``: parameter bytes, peak I/O
    bytes, peak total bytes, median latency over ``repeats`` calls, and per-step time and
    bytes of the optimized plan.

    ``optimized``: an existing ``OptimizedModule`` of ``model`` (else one is made with
    ``middleware.optimize(model, device=<the inputs' device>, **options)``). Both models run
    under ``torch.no_grad()``; the peaks are measured on a warm call (plans built).

    ``train=True``: one training step instead (forward, a mean-square loss, backward,
    an SGD-with-momentum step), time and peak memory, on copies of both models in
    training mode (the caller's weights are left as they are).
    """
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if optimized is None:
        device = inputs[0].device if inputs else torch.device("cpu")
        if train:  # a copy in training mode: its first step must not train the caller's
            optimized = optimize(copy.deepcopy(model).train(), device=device.type, **options)
        else:
            optimized = optimize(model, device=device.type, example_inputs=inputs, **options)
    if train:
        return measure_training(model, optimized, inputs, repeats=repeats, warmup=warmup)
    return measure(model, optimized, inputs, repeats=repeats, warmup=warmup)
