"""What an ``OptimizedModule`` accepts: the input signature, its checks and the messages
that tell the user what is wrong with an input and how to fix it."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

from ..errors import InputMismatchError, InputTypeError, MiddlewareError


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


def channels_last(x: torch.Tensor) -> bool:
    """Part of the signature: a 4-d input stored channels_last gets its own plan (which reads
    it without conversion and returns channels_last outputs, as PyTorch would)."""
    return (
        x.dim() == 4
        and not x.is_contiguous()
        and x.is_contiguous(memory_format=torch.channels_last)
    )


def dense_signature(inputs: Sequence[torch.Tensor]) -> tuple[Sequence[torch.Tensor], tuple]:
    """``(dense(inputs), signature)`` in one pass over the inputs, each one's signature
    ``(shape, dtype, device, channels_last)``: a call's lookup key, on the path every call of
    an optimized module takes (fewer tensor queries than the two functions apart)."""
    sig = []
    made = None
    for i, x in enumerate(inputs):
        if x.is_contiguous():
            cl = False
        elif x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
            cl = True
        else:
            x, cl = x.contiguous(), False
            if made is None:
                made = list(inputs)
            made[i] = x
        sig.append((tuple(x.shape), x.dtype, x.device, cl))
    return (inputs if made is None else tuple(made)), tuple(sig)


def dense(inputs: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
    """Inputs stored neither contiguous nor channels_last (a transposed or sliced view) are
    made contiguous: plans read their inputs in a declared layout."""
    if all(x.is_contiguous() or channels_last(x) for x in inputs):
        return inputs
    return tuple(x if x.is_contiguous() or channels_last(x) else x.contiguous() for x in inputs)


def describe_tensor(x: Any) -> str:
    if not isinstance(x, torch.Tensor):
        return type(x).__name__
    return f"{str(x.dtype).replace('torch.', '')}[{', '.join(map(str, x.shape))}] on {x.device}"


def unsupported_inputs(inputs: Sequence[torch.Tensor]) -> str | None:
    """Why the compiler must not see these inputs, or None. Zero-size tensors crash deep in
    the x86 scheduler (isl "cannot handle void expression" from isl_helpers.loop_bounds,
    reached through backend.can_run -> schedule_group -> stage_loops) and there is nothing
    to gain from compiling them."""
    for i, x in enumerate(inputs):
        if x.numel() == 0:
            return (
                f"input {i} ({describe_tensor(x)}) has no elements; the compiler does not "
                "schedule zero-size tensors, so this input signature runs as the original "
                "PyTorch code"
            )
    return None


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def rejected(model: nn.Module, inputs: Sequence[torch.Tensor], err: Exception) -> MiddlewareError:
    """The error for inputs the model itself refuses in eager PyTorch: what is wrong, the fix."""
    name = type(model).__name__
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    for i, x in enumerate(inputs):
        if isinstance(x, torch.Tensor) and len(dtypes) == 1 and x.dtype not in dtypes:
            (want,) = dtypes
            also = f" (or the model with model.to({x.dtype}))" if x.is_floating_point() else ""
            return InputTypeError(
                f"input {i} is {x.dtype} but {name}'s parameters are {want}: convert the input "
                f"with x.to({want}){also}; PyTorch itself fails on it: {first_line(err)}"
            )
    for i, x in enumerate(inputs):
        if not isinstance(x, torch.Tensor):
            return InputTypeError(
                f"input {i} is a {type(x).__name__}, which {name} rejects in eager PyTorch "
                f"too: {first_line(err)}; pass the inputs the original model accepts"
            )
    given = ", ".join(describe_tensor(x) for x in inputs)
    return InputMismatchError(
        f"{name} rejects the input(s) ({given}) in eager PyTorch too: {first_line(err)}; "
        "pass inputs the original model accepts (rank, channels, sizes)"
    )


def check_inputs(specs: Sequence[InputSpec] | None, inputs: Sequence[Any]) -> None:
    """Raise the user's error for inputs that are not tensors, or that do not match the
    compiled signature ``specs`` (rank, channels, dtype, device; None: nothing compiled)."""
    expected = "" if specs is None else "(" + ", ".join(s.describe() for s in specs) + ")"
    given = "(" + ", ".join(describe_tensor(x) for x in inputs) + ")"
    for i, x in enumerate(inputs):
        if not isinstance(x, torch.Tensor):
            raise InputTypeError(
                f"input {i} is a {type(x).__name__}; the optimized model takes tensors only"
                + (f"; signature expected {expected}, given {given}" if expected else "")
            )
    if specs is None:
        return
    if len(inputs) != len(specs):
        raise InputMismatchError(
            f"expected {len(specs)} inputs {expected}, got {len(inputs)}: {given}"
        )
    for i, (x, s) in enumerate(zip(inputs, specs, strict=True)):
        if x.dim() != s.rank:
            raise InputMismatchError(
                f"input {i}: expected rank {s.rank} ({s.describe()}), got rank {x.dim()} "
                f"({describe_tensor(x)}); signature expected {expected}, given {given}"
                + rank_fix(x.dim(), s.rank)
            )
        if s.channels is not None and int(x.shape[1]) != s.channels:
            raise InputMismatchError(
                f"input {i}: expected {s.channels} channels ({s.describe()}), got "
                f"{int(x.shape[1])} ({describe_tensor(x)}); signature expected {expected}, "
                f"given {given}"
            )
        if x.dtype != s.dtype:
            raise InputTypeError(
                f"input {i}: expected dtype {s.dtype} ({s.describe()}), got {x.dtype}; "
                f"signature expected {expected}, given {given}; convert the input with "
                f"x.to({s.dtype})"
            )
        if x.device != s.device:
            raise InputTypeError(
                f"input {i}: expected device {s.device} ({s.describe()}), got {x.device}; "
                f"move the input with .to('{s.device}'); signature expected {expected}, "
                f"given {given}"
            )


def rank_fix(got: int, want: int) -> str:
    if got == want - 1:
        return "; add the batch dimension with x.unsqueeze(0)"
    return f"; pass a {want}-d tensor"
