"""The buffer planner: liveness of every value over a plan's units, and one reused arena.

Given the units of a plan (in execution order), :func:`plan_memory` decides where each
value lives:

- ``view``: a view-like op (flatten, reshape, split, identity, ...), a ``to_layout`` that
  may answer with its input (:func:`_shares_storage`) or a fallback shares the storage of
  its input; the two are one *storage class* whose lifetime is the union (an op planned as
  a copy is copied at run time should ATen alias after all: :func:`_fresh_result`);
- ``inplace``: an elementwise op whose input class is dead afterwards writes into it
  (relu, batch-norm, add of a dead residual, ...: ``OutVariant.inplace_inputs``);
- ``arena``: the output of a unit that can write into a given tensor (a destination-passing
  ``Unit.out_fn``, or the ATen ``out=`` form of its op's registry entry, ``OpDef.out``)
  lives at a byte offset of one arena; classes whose lifetimes do not overlap share bytes
  (greedy by size, first fit, 64-byte alignment);
- ``slice``: an input of a concat is written straight into its slice of the concat's
  destination (through ``out=`` or, for a producer without one, a copy right after it);
  a concat whose inputs already sit side by side in one destination is a free view;
- ``spilled``: an arena-capable class that would raise the peak if it sat in the arena
  (the arena holds its size for the whole call, framework allocations come and go): it is
  allocated through the framework when first written, on every call;
- ``vendor``: what ATen allocates itself (convolutions have no ``out=`` on CPU oneDNN;
  copying their result into the arena costs more than it saves); the plan frees it at its
  last use;
- ``fresh``: anything the user receives (graph outputs and everything aliased with them)
  gets a fresh framework allocation on every call, so a later call never overwrites a
  tensor the user holds. Graph inputs and parameters are never written;
- ``owned``: a graph input that the caller hands over to the plan (the cut values of a
  batch-chunked plan, runtime/chunked.py): it dies at its last read like a vendor value.

``Options(check_memory=True)`` (``MIDDLEWARE_CHECK_MEMORY=1``) checks after every step
that no output lands in arena bytes other than its own class's (:class:`MemoryCheckError`).

The arena is one ``torch.empty(nbytes, dtype=torch.uint8)`` on the plan's device, made
when the plan is built; the wrapped step functions hold views of it, so it lives exactly as
long as the plan (and is released when the ``OptimizedModule`` that caches the plan is).

The stages live in modules of their own: ``storage_classes.py`` (which values share a
buffer), ``arena.py`` (lifetimes, spilling and arena offsets: the ``MemoryPlan``) and
``planned_steps.py`` (the step functions under the plan, and the memory check); the ops'
``out=`` forms and in-place inputs are facts of their registry entries (``OpDef.out``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..graph import Graph
from .arena import MemoryPlan, Placement, plan_buffers
from .planned_steps import MemoryCheckError, PlannedUnits, build_steps, empty_of

__all__ = ["MemoryCheckError", "MemoryPlan", "Placement", "PlannedUnits", "plan_memory"]

# runtime/chunked.py's name for a framework allocation of a value type
_empty = empty_of


def plan_memory(
    graph: Graph,
    units: Sequence[Any],
    device: torch.device,
    owned: Sequence[str] = (),
    check: bool | None = None,
    huge_pages: bool = False,
    arena_max: int | None = None,
) -> PlannedUnits:
    """Plan the buffers of ``units`` (``runtime.plan.Unit`` records, in execution order).

    Returns step functions with the units' calling convention that write into the arena,
    in place or into concat slices where the plan says so; they compute the same values.
    ``check`` (default: ``Options.check_memory``'s default, i.e. ``MIDDLEWARE_CHECK_MEMORY``)
    wraps every step with ``planned_steps._checked``, which raises :class:`MemoryCheckError` when an
    output lands in arena bytes its value was not planned in. ``huge_pages``: the arena,
    recycled outputs and spilled classes ask for 2 MiB pages (runtime/pages.py).
    ``arena_max``: where the planner spilled classes to framework allocations (to lower
    the peak), keep every class in the arena instead if the arena then stays within these
    bytes (the native runner needs every intermediate at a fixed address).
    """
    plan = plan_buffers(graph, units, device, owned)
    if arena_max is not None and any(w == "spilled" for w in plan.where.values()):
        whole = plan_buffers(graph, units, device, owned, spill=False)
        if whole.memory.arena_bytes <= arena_max:
            plan = whole
    return build_steps(graph, units, device, plan, check, huge_pages)
