"""``OptimizedModule``: the ``torch.nn.Module`` that ``optimize()`` hands back."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn

from ..errors import (
    InputMismatchError,
    InputTypeError,
    TraceError,
    TrainingModeError,
    UnsupportedError,
)
from ..graph import Graph
from ..options import Options
from .plan import Plan
from .report import Report, ReportRow


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """What a compiled model accepts for one input: the rank, the channel count (dim 1),
    dtype and device are fixed; the batch and spatial sizes may change between calls."""

    rank: int
    channels: int | None
    dtype: torch.dtype
    device: torch.device

    def describe(self) -> str:
        dims = (
            ["N"]
            + ([str(self.channels)] if self.channels is not None else [])
            + [f"d{i}" for i in range(2, self.rank)]
        )
        if self.rank == 1:
            dims = ["N"]
        return f"{str(self.dtype).replace('torch.', '')}[{', '.join(dims[: self.rank])}] on {self.device}"

    @staticmethod
    def of(x: torch.Tensor) -> InputSpec:
        return InputSpec(x.dim(), int(x.shape[1]) if x.dim() >= 2 else None, x.dtype, x.device)


def _cl(x: torch.Tensor) -> bool:
    """Part of the signature: a 4-d input stored channels_last gets its own plan (which reads
    it without conversion and returns channels_last outputs, as PyTorch would)."""
    return (
        x.dim() == 4
        and not x.is_contiguous()
        and x.is_contiguous(memory_format=torch.channels_last)
    )


def _dense(inputs: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
    """Inputs stored neither contiguous nor channels_last (a transposed or sliced view) are
    made contiguous: plans read their inputs in a declared layout."""
    if all(x.is_contiguous() or _cl(x) for x in inputs):
        return inputs
    return tuple(x if x.is_contiguous() or _cl(x) else x.contiguous() for x in inputs)


def _describe_tensor(x: Any) -> str:
    if not isinstance(x, torch.Tensor):
        return type(x).__name__
    return f"{str(x.dtype).replace('torch.', '')}[{', '.join(map(str, x.shape))}] on {x.device}"


@dataclasses.dataclass
class Compiled:
    """One input signature's passed graph, plan and report."""

    graph: Graph
    plan: Plan
    report: Report


class OptimizedModule(nn.Module):
    """Runs a model through the middleware's plans; same outputs as the original model.

    One plan is built and cached per input signature (shapes, dtype, device). Attributes:
    ``graph`` (the passed graph of the latest signature) and ``report()``.
    """

    def __init__(
        self,
        model: nn.Module,
        options: Options,
        compile_fn: Callable[[nn.Module, Sequence[torch.Tensor], Options], Compiled],
        example_inputs: Sequence[torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        # Not registered as a submodule: .to()/.half() on this module must never reach
        # (and so modify) the user's model.
        object.__setattr__(self, "_original", model)
        object.__setattr__(self, "_compile_fn", compile_fn)
        self.train(False)  # an inference module; train() does not change what it computes
        self.options = options
        self._plans: dict[tuple, Compiled] = {}
        self._specs: list[InputSpec] | None = None
        self._latest: Compiled | None = None
        self._fallback_reason: str | None = None
        if example_inputs is not None:
            inputs = (
                tuple(example_inputs)
                if not isinstance(example_inputs, torch.Tensor)
                else (example_inputs,)
            )
            self._check_types(inputs)
            self._compile(inputs, self._signature(inputs))

    @property
    def original(self) -> nn.Module:
        return self._original

    @property
    def graph(self) -> Graph | None:
        """The passed graph of the latest input signature (None before the first call)."""
        return None if self._latest is None else self._latest.graph

    @property
    def signatures(self) -> list[tuple]:
        """The input signatures (per input: shape, dtype, device) with a cached plan."""
        return list(self._plans)

    @property
    def plan(self) -> Plan | None:
        return None if self._latest is None else self._latest.plan

    def report(self) -> Report:
        """What ran where and why, for the latest input signature."""
        if self._fallback_reason is not None:
            row = ReportRow(
                node=type(self._original).__name__,
                op="model",
                bound="-",
                group=None,
                runs_as="fallback",
                reason=self._fallback_reason,
            )
            return Report((row,), notes=("the whole model runs as the original PyTorch code",))
        if self._latest is None:
            return Report(
                (),
                notes=(
                    "not compiled yet: call the module once (or pass example_inputs to optimize())",
                ),
            )
        return self._latest.report

    # ------------------------------------------------------------------ calling
    @staticmethod
    def _signature(inputs: Sequence[torch.Tensor]) -> tuple:
        return tuple((tuple(x.shape), x.dtype, x.device, _cl(x)) for x in inputs)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self._fallback_reason is not None:
            return self._original(*inputs, **kwargs)
        if kwargs:
            raise InputTypeError(
                f"keyword inputs ({', '.join(kwargs)}) are not supported; pass tensors positionally"
            )
        try:
            inputs = _dense(inputs)
            sig = tuple((tuple(x.shape), x.dtype, x.device, _cl(x)) for x in inputs)
        except AttributeError:
            self._check_types(inputs)
            raise
        entry = self._plans.get(sig)
        if entry is None:
            self._check_types(inputs)
            entry = self._compile(inputs, sig)
            if entry is None:
                return self._original(*inputs)
        self._latest = entry
        with torch.no_grad():
            return entry.plan.run(inputs)

    def _check_types(self, inputs: Sequence[Any]) -> None:
        expected = (
            "" if self._specs is None else "(" + ", ".join(s.describe() for s in self._specs) + ")"
        )
        given = "(" + ", ".join(_describe_tensor(x) for x in inputs) + ")"
        for i, x in enumerate(inputs):
            if not isinstance(x, torch.Tensor):
                raise InputTypeError(
                    f"input {i} is a {type(x).__name__}; the optimized model takes tensors only"
                    + (f"; signature expected {expected}, given {given}" if expected else "")
                )
        if self._specs is None:
            return
        if len(inputs) != len(self._specs):
            raise InputMismatchError(
                f"expected {len(self._specs)} inputs {expected}, got {len(inputs)}: {given}"
            )
        for i, (x, s) in enumerate(zip(inputs, self._specs, strict=True)):
            if x.dim() != s.rank:
                raise InputMismatchError(
                    f"input {i}: expected rank {s.rank} ({s.describe()}), got rank {x.dim()} "
                    f"({_describe_tensor(x)}); signature expected {expected}, given {given}"
                )
            if s.channels is not None and int(x.shape[1]) != s.channels:
                raise InputMismatchError(
                    f"input {i}: expected {s.channels} channels ({s.describe()}), got "
                    f"{int(x.shape[1])} ({_describe_tensor(x)}); signature expected {expected}, "
                    f"given {given}"
                )
            if x.dtype != s.dtype:
                raise InputTypeError(
                    f"input {i}: expected dtype {s.dtype} ({s.describe()}), got {x.dtype}; "
                    f"signature expected {expected}, given {given}"
                )
            if x.device != s.device:
                raise InputTypeError(
                    f"input {i}: expected device {s.device} ({s.describe()}), got {x.device}; "
                    f"move the input with .to('{s.device}'); signature expected {expected}, "
                    f"given {given}"
                )

    def _compile(self, inputs: Sequence[torch.Tensor], sig: tuple) -> Compiled | None:
        if self._original.training:  # switched back to training after optimize()
            raise TrainingModeError(
                f"{type(self._original).__name__} is in training mode; training is not yet "
                "supported. Call model.eval() before running the optimized model"
            )
        device = torch.device(self.options.device)
        for i, x in enumerate(inputs):
            if x.device.type != device.type:
                raise InputTypeError(
                    f"input {i} is on {x.device} but the model was optimized for "
                    f"device={self.options.device!r}; move the input with .to('{device}')"
                )
        try:
            entry = self._compile_fn(self._original, inputs, self.options)
        except (TraceError, UnsupportedError) as e:
            if self.options.strict:
                raise
            reason = str(e)
            warnings.warn(
                f"middleware: running {type(self._original).__name__} as the original "
                f"PyTorch model: {reason}",
                stacklevel=3,
            )
            self._fallback_reason = reason
            return None
        if self._specs is None:
            self._specs = [InputSpec.of(x) for x in inputs]
        self._plans[sig] = entry
        self._latest = entry
        return entry

    def profile(self, inputs: Sequence[torch.Tensor] | torch.Tensor, **kwargs: Any) -> Any:
        """Peak memory and latency of the original and this optimized model side by side
        (``middleware.profile``); returns a ``ProfileResult``."""
        from ..profiler import profile

        return profile(self._original, inputs, optimized=self, **kwargs)

    def extra_repr(self) -> str:
        return (
            f"original={type(self._original).__name__}, device={self.options.device!r}, "
            f"signatures={len(self._plans)}"
        )
