"""Checking a rewrite: the graph before and after a pass compute the same outputs.

Both graphs run on the reference interpreter (``Graph.evaluate``) with the same seeded
random inputs; the error is measured relative to the scale of the reference outputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..graph import Graph, map_tree
from ..ops import torch_dtype


def random_inputs(graph: Graph, seed: int = 0) -> list[torch.Tensor]:
    """Seeded inputs of ``graph``'s input types (standard normal; integers in [0, 10))."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for v in graph.inputs:
        t = graph.values[v]
        dtype = torch_dtype(t.dtype)
        if dtype.is_floating_point:
            x = torch.randn(t.shape, generator=gen, dtype=torch.float32).to(dtype)
        else:
            x = torch.randint(0, 10, t.shape, generator=gen).to(dtype)
        if t.layout == "nhwc" and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        out.append(x)
    return out


def relative_error(expected: Any, actual: Any) -> float:
    """max |expected - actual| / max |expected| over every tensor of two output structures
    (the scale is at least 1e-12)."""
    exp = _tensors(expected)
    act = _tensors(actual)
    if len(exp) != len(act):
        raise AssertionError(f"{len(exp)} outputs expected, got {len(act)}")
    err, scale = 0.0, 1e-12
    for e, a in zip(exp, act, strict=True):
        if e.shape != a.shape:
            raise AssertionError(f"shape {tuple(a.shape)} where {tuple(e.shape)} was expected")
        if e.numel():
            err = max(err, (e.double() - a.double()).abs().max().item())
            scale = max(scale, e.double().abs().max().item())
    return err / scale


def _tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        tree = list(tree.values())
    if isinstance(tree, (tuple, list)):
        return [t for x in tree for t in _tensors(x)]
    return []


def check_equivalent(
    before: Graph,
    after: Graph,
    inputs: Sequence[torch.Tensor] | None = None,
    seed: int = 0,
    tol: float = 1e-5,
) -> float:
    """Evaluate both graphs on ``inputs`` (seeded random ones by default); raises
    ``AssertionError`` when the relative error exceeds ``tol``; returns the error."""
    if list(before.inputs) != list(after.inputs):
        raise AssertionError(f"inputs differ: {before.inputs} vs {after.inputs}")
    same_structure = map_tree(before.output_tree, lambda v: 0) == map_tree(
        after.output_tree, lambda v: 0
    )
    if not same_structure:
        raise AssertionError("the output structures differ")
    xs = list(inputs) if inputs is not None else random_inputs(before, seed)
    with torch.no_grad():
        err = relative_error(before.evaluate(*xs), after.evaluate(*xs))
    if not err <= tol:
        raise AssertionError(f"relative error {err:.3g} > {tol:g}")
    return err
