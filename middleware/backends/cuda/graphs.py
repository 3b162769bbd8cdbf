"""Replay a whole CUDA plan as one CUDA graph (launch overhead gone; on by default,
``Options(cuda_graphs=False)`` switches it off).

``GraphedPlan(plan, example_inputs)`` runs the plan twice on a side stream (warm-up:
cuDNN's algorithm search, the caching allocator's pools), captures one run with
``torch.cuda.graph`` and then answers each call by copying the inputs into the captured
input buffers, replaying the graph and returning clones of the outputs (the captured output
buffers are overwritten by the next replay; a clone is what a user may keep). Generated
kernels are captured too: they launch on ``torch.cuda.current_stream()``, which is the
capture stream during capture. A plan that cannot be captured (a step that synchronises
with the host) raises at construction; callers then keep running the plan itself.

Replay is not always faster: each call copies its inputs into the captured buffers and
clones the outputs, which for a plan of a few kernels over large tensors costs more than
the launches it saves (a one-kernel BN -> ReLU -> max-pool plan on 16x64x112x112: the
input copy alone moves as many bytes as the kernel reads). With ``Options(cuda_graphs=
"auto")`` (the default) ``CudaGraphPlan`` times both ways right after the capture, back to
back as a caller would run them, and keeps the faster; the report's notes give both times.
"""

from __future__ import annotations

import statistics
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch


def _clone_tree(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, (list, tuple)):
        items = [_clone_tree(t) for t in tree]
        return type(tree)(*items) if hasattr(tree, "_fields") else type(tree)(items)
    if isinstance(tree, dict):
        return type(tree)((k, _clone_tree(v)) for k, v in tree.items())
    return tree


class GraphedPlan:
    """A plan captured once for fixed input shapes; ``run(inputs)`` replays it."""

    def __init__(self, plan: Any, example_inputs: Sequence[torch.Tensor], warmup: int = 2) -> None:
        self.plan = plan
        self.static_inputs = [x.clone() for x in example_inputs]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(side):
            for _ in range(warmup):
                plan.run(self.static_inputs)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(self.graph):
            self.static_outputs = plan.run(self.static_inputs)

    def run(self, inputs: Sequence[torch.Tensor], clone: bool = True) -> Any:
        """The plan's outputs for ``inputs``. Inputs that are the captured input buffers
        themselves (``static_inputs``) are not copied; ``clone=False`` returns the captured
        output buffers, which the next replay overwrites."""
        for dst, src in zip(self.static_inputs, inputs, strict=True):
            if dst.data_ptr() != src.data_ptr():
                dst.copy_(src)
        self.graph.replay()
        return _clone_tree(self.static_outputs) if clone else self.static_outputs

    __call__ = run


class CudaGraphPlan:
    """A plan that replays as one CUDA graph: captured on its first call (the shapes of a
    plan are static), then each call copies its inputs into the captured buffers, replays
    and returns clones of the outputs. The caching allocator provides every buffer (the
    capture's private pool). A plan that cannot be captured (a step that synchronises
    with the host, a fallback that reads a tensor's value) runs step by step from then on,
    and ``notes`` says why. A second thread calling while a replay is under way runs the
    plan step by step (the captured buffers are shared)."""

    def __init__(self, plan: Any, decide: bool = False) -> None:
        self.plan = plan
        self.graphed: GraphedPlan | None = None
        self.failed: str | None = None
        # decide: time replay against step by step after the capture and keep the faster
        self.decide = decide
        self.chosen: str | None = None  # "graph" or "steps" once decided
        self.timings: tuple[float, float] | None = None  # (graph ms, steps ms) per call
        self._busy = threading.Lock()

    def __getattr__(self, name: str) -> Any:  # steps, arenas(), param_tensors(), ...
        return getattr(self.__dict__["plan"], name)

    def __deepcopy__(self, memo: dict[int, Any]) -> CudaGraphPlan:
        return self

    @property
    def notes(self) -> tuple[str, ...]:
        if self.failed:
            own = f"CUDA graph capture failed ({self.failed}); the plan runs step by step"
        elif self.timings is not None:
            g, st = self.timings
            measured = (
                f"measured {g:.3f} ms per call replayed (input copies and output clones "
                f"included) against {st:.3f} ms step by step"
            )
            own = (
                f"the plan replays as one CUDA graph: {measured} (Options(cuda_graphs=False) "
                "runs it step by step)"
                if self.chosen == "graph"
                else f"the plan runs step by step: {measured} (Options(cuda_graphs=True) "
                "replays it anyway)"
            )
        else:
            own = (
                "the plan replays as one CUDA graph (Options(cuda_graphs=False) runs it "
                "step by step)"
            )
        return (*getattr(self.plan, "notes", ()), own)

    def run(self, inputs: Sequence[torch.Tensor]) -> Any:
        if (
            self.failed is not None
            or self.chosen == "steps"
            or not self._busy.acquire(blocking=False)
        ):
            return self.plan.run(inputs)
        try:
            if self.graphed is None and not self.capture(inputs):
                return self.plan.run(inputs)
            graphed = self.graphed
            if graphed is None:  # captured and timed, and step by step measured faster
                return self.plan.run(inputs)
            return graphed.run(inputs)
        finally:
            self._busy.release()

    def capture(self, inputs: Sequence[torch.Tensor]) -> bool:
        """Capture the plan on ``inputs`` (warm-up runs included); False (and ``failed``
        set, with a warning) when the plan cannot be captured."""
        try:
            self.graphed = GraphedPlan(self.plan, [x.detach() for x in inputs])
            if self.decide:  # a tuple: a plan may empty a list it is handed (owned inputs)
                self._choose(tuple(x.detach() for x in inputs))
            return True
        except Exception as exc:  # noqa: BLE001 - any capture failure: run uncaptured
            self.failed = f"{type(exc).__name__}: {exc}"[:300]
            warnings.warn(
                f"middleware: the CUDA plan cannot be captured as a CUDA graph ({self.failed}); "
                "it runs step by step",
                RuntimeWarning,
                stacklevel=3,
            )
            try:
                torch.cuda.synchronize()
            except Exception:  # noqa: BLE001 - a broken capture may leave an error behind
                pass
            return False

    def _choose(self, inputs: tuple[torch.Tensor, ...]) -> None:
        """Time replay (copies and clones included) against step by step on ``inputs``,
        interleaved, and keep the faster; a replay must win by ``GRAPH_MARGIN`` to be kept
        (it also holds the captured buffers)."""
        graphed = self.graphed
        assert graphed is not None
        with torch.no_grad():
            ms = time_interleaved(
                {"graph": lambda: graphed.run(inputs), "steps": lambda: self.plan.run(inputs)}
            )
        self.timings = (ms["graph"], ms["steps"])
        if ms["graph"] * GRAPH_MARGIN <= ms["steps"]:
            self.chosen = "graph"
        else:
            self.chosen = "steps"
            self.graphed = None  # its private memory pool goes back to the allocator


# A replay must be at least this much faster than step by step to be chosen.
GRAPH_MARGIN = 1.03


def time_interleaved(
    fns: dict[str, Callable[[], Any]], rounds: int = 5, calls: int = 4
) -> dict[str, float]:
    """Median milliseconds per call of each function, ``calls`` back-to-back calls between
    two CUDA events per round (the host's own time per call shows when it is the longer),
    the functions taking turns in every round after one untimed round."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    stream = torch.cuda.current_stream()
    for r in range(rounds):
        order = list(fns) if r % 2 == 0 else list(reversed(fns))
        for k in order:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            for _ in range(calls):
                fns[k]()
            end.record(stream)
            end.synchronize()
            times[k].append(start.elapsed_time(end) / calls)
    return {k: statistics.median(v) for k, v in times.items()}
