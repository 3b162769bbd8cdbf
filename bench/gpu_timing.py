"""The CUDA timing loop the GPU benchmarks share (``gpu_chain.py``, ``gpu_zoo.py``,
``cuda_layout.py``): modes interleaved in every round, timed with CUDA events."""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable
from typing import Any

import torch


def cuda_medians(
    fns: dict[str, Callable[[], Any]], repeat: int, warmup: int, inner: int = 1
) -> dict[str, float]:
    """Median milliseconds per call of each mode over ``repeat`` rounds (modes in a new
    random order each round) after
    ``warmup`` untimed ones; a round times ``inner`` back-to-back calls between two events
    (more than one hides the launch latency)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {k: [] for k in fns}
    order = list(fns)
    rng = random.Random(0)
    for _ in range(repeat):
        rng.shuffle(order)  # a new order every round: no mode always follows the same one
        for k in order:
            fn = fns[k]
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            times[k].append(start.elapsed_time(end) / inner)
    return {k: statistics.median(v) for k, v in times.items()}
