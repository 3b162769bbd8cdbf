"""Following the user's weights: a snapshot of the model's parameters and buffers, checked
on every call, so that plans built from old weights are rebuilt."""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.nn.modules import module as nn_module

_VERSION = operator.attrgetter("_version")

# Bumped whenever any nn.Module registers a parameter, buffer or submodule (``m.w =
# nn.Parameter(...)``, ``load_state_dict(assign=True)``): replacing a tensor object moves no
# version counter, and walking the model on every call would cost more than the check.
_registrations = [0]
_hooks_installed = False


def _count_registration(*_: Any) -> None:
    _registrations[0] += 1


def registrations() -> int:
    """How many parameters, buffers and submodules have been registered in this process."""
    return _registrations[0]


def registration_cell() -> list[int]:
    """The list whose one item is :func:`registrations` (the C++ call reads it in place)."""
    return _registrations


def install_registration_hooks() -> None:
    """Count every registration of a parameter, buffer or submodule (once per process)."""
    global _hooks_installed
    if _hooks_installed:
        return
    nn_module.register_module_parameter_registration_hook(_count_registration)
    nn_module.register_module_buffer_registration_hook(_count_registration)
    nn_module.register_module_module_registration_hook(_count_registration)
    _hooks_installed = True


def _identity(t: torch.Tensor) -> tuple:
    try:
        ptr = t.data_ptr()
    except RuntimeError:  # a tensor without plain storage (sparse): shape, dtype, device only
        ptr = None
    return (ptr, tuple(t.shape), t.dtype, t.device)


def _version(t: torch.Tensor) -> int:
    # Inference tensors (made under torch.inference_mode()) have no version counter.
    return -1 if t.is_inference() else t._version


@dataclasses.dataclass(frozen=True)
class WeightSnapshot:
    """The user's parameters and buffers as the plans were built from them.

    Plans hold copies of the weights (prepacked oneDNN weights, Winograd-transformed weights,
    batch-norm folded into convolutions), so a change to the model must rebuild them.
    ``current()`` is the per-call check: one map over the version counters, compared in one
    go, and one integer; the identities (storage, shape, dtype, device) are compared only when
    that fails and when a new signature compiles.
    """

    names: tuple[str, ...]
    tensors: tuple[torch.Tensor, ...]
    versions: tuple[int, ...]  # per name, -1 for an inference tensor
    identities: tuple[tuple, ...]
    epoch: int
    tracked: tuple[torch.Tensor, ...]  # the tensors with a version counter
    tracked_versions: tuple[int, ...]

    @staticmethod
    def take(model: nn.Module) -> WeightSnapshot:
        named = list(model.named_parameters()) + list(model.named_buffers())
        tensors = tuple(t for _, t in named)
        tracked = tuple(t for t in tensors if not t.is_inference())
        return WeightSnapshot(
            names=tuple(n for n, _ in named),
            tensors=tensors,
            versions=tuple(map(_version, tensors)),
            identities=tuple(map(_identity, tensors)),
            epoch=_registrations[0],
            tracked=tracked,
            tracked_versions=tuple(map(_VERSION, tracked)),
        )

    def current(self) -> bool:
        return (
            _registrations[0] == self.epoch
            and tuple(map(_VERSION, self.tracked)) == self.tracked_versions
        )

    def changed(self, now: WeightSnapshot) -> list[str]:
        """Names of the tensors that differ between this snapshot and ``now`` (a replaced
        tensor object, new or removed names, moved storage, or an in-place write)."""
        if self.names != now.names:
            return sorted(set(self.names) ^ set(now.names)) or ["(parameter order)"]
        return [
            name
            for name, a, b, va, vb, ia, ib in zip(
                self.names,
                self.tensors,
                now.tensors,
                self.versions,
                now.versions,
                self.identities,
                now.identities,
                strict=True,
            )
            if a is not b or va != vb or ia != ib
        ]


def describe_names(names: Sequence[str], limit: int = 3) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" (+{len(names) - limit} more)" if len(names) > limit else "")
