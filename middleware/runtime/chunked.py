"""Depth-first over the batch: the first layers of a network run on slices of the batch.

The batch-slicing pass (``passes/batch_slice.py``) chooses the prefix and the slice size
(a :class:`~middleware.passes.batch_slice.Cut`) and splits the graph into the prefix graph
(at the slice's batch) and the suffix graph (whose inputs are the cut values).
:class:`ChunkedPlan` runs the prefix plan once per slice, writes each slice's results into
the full-batch cut tensors and hands them to the suffix plan.

It is also faster here: one sample's intermediates stay in the caches between layers and
the small per-slice buffers are reused without page faults (measured on this machine at
batch 16: the mobilenet_v2 stem 83 -> 35 ms, the vgg16 stem 888 -> 709 ms, resnet18's
stem and layer1 106 -> 93 ms; ``bench/zoo.py`` has the whole networks).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from ..graph import Graph
from ..passes.batch_slice import Cut
from .memory import _empty
from .plan import Plan


# ------------------------------------------------------------------------- the plan
class ChunkedPlan:
    """A prefix plan run once per slice of the batch, then a suffix plan on the full batch.

    Offers what callers use of :class:`Plan` (``run``, ``steps``, ``graph``, the memory
    queries of the profiler); ``prefix`` and ``suffix`` are the two plans.
    """

    def __init__(self, graph: Graph, cut: Cut, prefix: Plan, suffix: Plan, device: Any) -> None:
        self.graph = graph
        self.cut = cut
        self.prefix = prefix
        self.suffix = suffix
        self.device = torch.device(device)
        self._pre_in = [graph.inputs.index(v) for v in prefix.graph.inputs]
        n_cut = len(cut.values)
        self._post_in = [graph.inputs.index(v) for v in suffix.graph.inputs[n_cut:]]
        self._cut_types = [graph.values[v] for v in cut.values]
        self._slices = [(b, cut.chunk) for b in range(0, cut.batch, cut.chunk)]
        self.notes = (cut.describe(),)

    def __deepcopy__(self, memo: dict[int, Any]) -> ChunkedPlan:
        return self  # immutable once built, like Plan

    @property
    def steps(self) -> list:
        return list(self.prefix.steps) + list(self.suffix.steps)

    @property
    def memory(self) -> Any:
        """The suffix's buffer plan (None when the buffer planner is off)."""
        return self.suffix.memory

    def run(self, inputs: Sequence[torch.Tensor]) -> Any:
        # the suffix plan frees each cut tensor after its last read: no other reference
        # to them may outlive this line (hence the helper's own frame)
        handed = self._run_prefix(inputs) + [inputs[i] for i in self._post_in]
        return self.suffix.run(handed)

    def _run_prefix(
        self, inputs: Sequence[torch.Tensor], run_slice: Any = None
    ) -> list[torch.Tensor]:
        """The cut values at full batch, written slice by slice by the prefix plan
        (``run_slice``: how a slice runs, ``self.prefix.run`` unless timed)."""
        run_slice = run_slice or self.prefix.run
        cut = [_empty(t, self.device) for t in self._cut_types]
        full = [inputs[i] for i in self._pre_in]
        for b, m in self._slices:
            outs = run_slice([x.narrow(0, b, m) for x in full])
            for c, o in zip(cut, outs, strict=True):
                c.narrow(0, b, m).copy_(o)
        return cut

    # -------------------------------------------------------- what the profiler asks
    def arenas(self) -> list[torch.Tensor]:
        return self.prefix.arenas() + self.suffix.arenas()

    def param_tensors(self) -> list[torch.Tensor]:
        return self.prefix.param_tensors() + self.suffix.param_tensors()

    def held_tensors(self) -> list[torch.Tensor]:
        return self.prefix.held_tensors() + self.suffix.held_tensors()

    @property
    def arena_bytes(self) -> int:
        return self.prefix.arena_bytes + self.suffix.arena_bytes

    def step_placements(self) -> list[str]:
        return self.prefix.step_placements() + self.suffix.step_placements()

    def step_out_bytes(self) -> list[int]:
        return self.prefix.step_out_bytes() + self.suffix.step_out_bytes()

    def predicted_peak_io(self) -> int | None:
        """Inputs + both arenas + the cut tensors + a slice's framework allocations while
        the prefix runs; the suffix's prediction (its inputs are the cut tensors and the
        graph inputs it reads) + the other inputs and the prefix's arena after."""
        pm, sm = self.prefix.memory, self.suffix.memory
        if pm is None or sm is None:
            return None
        inputs = sum(self.graph.values[v].nbytes for v in self.graph.inputs)
        cut = sum(t.nbytes for t in self._cut_types)
        read_after = sum(self.graph.values[self.graph.inputs[i]].nbytes for i in self._post_in)
        during = inputs + self.arena_bytes + cut + pm.vendor_peak_bytes()
        after = sm.predicted_peak_io() + pm.arena_bytes + inputs - read_after
        return max(during, after)

    def step_times(self, inputs: Sequence[torch.Tensor], repeats: int) -> list[float]:
        """Median milliseconds of each step: a prefix step's time sums its slices, and the
        last prefix step also carries the copies of the slices into the cut."""
        pre_t: list[list[float]] = [[] for _ in self.prefix.steps]
        post_t: list[list[float]] = [[] for _ in self.suffix.steps]
        for _ in range(repeats):
            sums = [0.0] * len(pre_t)

            def timed_slice(xs: list[torch.Tensor], sums: list[float] = sums) -> Any:
                ts, outs = self.prefix.timed_run(xs)
                for k, t in enumerate(ts):
                    sums[k] += t
                return outs

            t0 = time.perf_counter()
            cut = self._run_prefix(inputs, timed_slice)
            sums[-1] += (time.perf_counter() - t0) * 1e3 - sum(sums)
            for lst, s in zip(pre_t, sums, strict=True):
                lst.append(s)
            ts, _ = self.suffix.timed_run(cut + [inputs[i] for i in self._post_in])
            for lst, t in zip(post_t, ts, strict=True):
                lst.append(t)
        return [statistics.median(t) for t in pre_t + post_t]
