"""The CUDA C spelling of every scalar operation (one table, like a renderer's ``code_for_op``).

Spellings are plain CUDA C that also compiles as C++ on the CPU (with ``emulate.h``), and
follow PyTorch's formulas so that results agree to float rounding. No fast-math intrinsics.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from ...errors import UnsupportedError


def flt(v: float) -> str:
    """A float as a CUDA C single-precision literal."""
    v = float(v)
    if math.isnan(v):
        return "NAN"
    if math.isinf(v):
        return "INFINITY" if v > 0 else "(-INFINITY)"
    return f"{v!r}f"


def _gelu(x: str, attrs: Mapping[str, Any]) -> str:
    if attrs.get("approximate", "none") == "tanh":
        return (
            f"(0.5f * {x} * (1.0f + tanhf(0.7978845608028654f * "
            f"({x} + 0.044715f * {x} * {x} * {x}))))"
        )
    return f"(0.5f * {x} * (1.0f + erff({x} * 0.7071067811865476f)))"


def _clamp(x: str, lo: str, hi: str) -> str:
    """``x`` clamped to ``[lo, hi]`` with PyTorch's NaN semantics (``clamp``/``hardtanh``
    of NaN is NaN): both comparisons are false for a NaN, which passes through.
    ``fminf(fmaxf(x, lo), hi)`` would return ``lo``: fmaxf drops a NaN operand."""
    return f"(({x}) < {lo} ? {lo} : (({x}) > {hi} ? {hi} : ({x})))"


# op name -> (x, attrs) -> C expression of one float ``x``; NaN and +-inf give what
# PyTorch gives (relu(NaN) = NaN: ``x < 0`` is false for a NaN)
UNARY: dict[str, Callable[[str, Mapping[str, Any]], str]] = {
    "relu": lambda x, a: f"({x} < 0.0f ? 0.0f : {x})",
    "hardtanh": lambda x, a: _clamp(x, flt(a.get("min_val", -1.0)), flt(a.get("max_val", 1.0))),
    "leaky_relu": lambda x, a: f"({x} > 0.0f ? {x} : {x} * {flt(a.get('negative_slope', 0.01))})",
    "sigmoid": lambda x, a: f"(1.0f / (1.0f + expf(-{x})))",
    "tanh": lambda x, a: f"tanhf({x})",
    "silu": lambda x, a: f"({x} / (1.0f + expf(-{x})))",
    "hardswish": lambda x, a: f"({x} * {_clamp(f'{x} + 3.0f', '0.0f', '6.0f')} / 6.0f)",
    "hardsigmoid": lambda x, a: f"({_clamp(f'{x} + 3.0f', '0.0f', '6.0f')} / 6.0f)",
    "gelu": _gelu,
    "identity": lambda x, a: x,
    "dropout": lambda x, a: x,
    "contiguous": lambda x, a: x,
    # a change of memory order only: the output's layout decides where the element goes
    "to_layout": lambda x, a: x,
}


def unary(op: str, x: str, attrs: Mapping[str, Any]) -> str:
    """The C expression of activation ``op`` applied to the C expression ``x``."""
    try:
        return UNARY[op](x, attrs)
    except KeyError:
        raise UnsupportedError(f"the CUDA backend has no scalar spelling for {op!r}") from None


def binary(op: str, x: str, y: str, alpha: float = 1.0) -> str:
    """``x op y`` (``alpha`` scales ``y`` for add/sub, as in ``torch.add``)."""
    if op in ("add", "sub"):
        yy = y if alpha == 1 else f"({flt(alpha)} * {y})"
        return f"({x} {'+' if op == 'add' else '-'} {yy})"
    if op == "mul":
        return f"({x} * {y})"
    if op == "div":
        return f"({x} / {y})"
    raise UnsupportedError(f"the CUDA backend has no binary spelling for {op!r}")
