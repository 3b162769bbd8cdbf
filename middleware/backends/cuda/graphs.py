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
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Sequence
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

    def __init__(self, plan: Any) -> None:
        self.plan = plan
        self.graphed: GraphedPlan | None = None
        self.failed: str | None = None
        self._busy = threading.Lock()

    def __getattr__(self, name: str) -> Any:  # steps, arenas(), param_tensors(), ...
        return getattr(self.__dict__["plan"], name)

    def __deepcopy__(self, memo: dict[int, Any]) -> CudaGraphPlan:
        return self

    @property
    def notes(self) -> tuple[str, ...]:
        own = (
            f"CUDA graph capture failed ({self.failed}); the plan runs step by step"
            if self.failed
            else "the plan replays as one CUDA graph (Options(cuda_graphs=False) runs it "
            "step by step)",
        )
        return tuple(getattr(self.plan, "notes", ())) + own

    def run(self, inputs: Sequence[torch.Tensor]) -> Any:
        if self.failed is not None or not self._busy.acquire(blocking=False):
            return self.plan.run(inputs)
        try:
            if self.graphed is None and not self.capture(inputs):
                return self.plan.run(inputs)
            return self.graphed.run(inputs)
        finally:
            self._busy.release()

    def capture(self, inputs: Sequence[torch.Tensor]) -> bool:
        """Capture the plan on ``inputs`` (warm-up runs included); False (and ``failed``
        set, with a warning) when the plan cannot be captured."""
        try:
            self.graphed = GraphedPlan(self.plan, [x.detach() for x in inputs])
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
