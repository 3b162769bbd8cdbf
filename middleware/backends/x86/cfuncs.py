"""The x86 backend's one table from scalar function (``middleware.loops.FUNCTIONS``) to its
C spelling, and the C text of expressions, constants and addresses."""

from __future__ import annotations

import math
from collections.abc import Callable

from ...loops import Acc, Call, Const, Expr, Load, ParamVec

C_FUNCS: dict[str, str] = {
    "add": "({0} + {1})",
    "sub": "({0} - {1})",
    "mul": "({0} * {1})",
    "div": "({0} / {1})",
    # NaN-propagating (PyTorch's semantics for relu, clamp/hardtanh, max-pooling,
    # torch.maximum): defined in the templates, see group.c.j2
    "max": "mw_max({0}, {1})",
    "min": "mw_min({0}, {1})",
    "neg": "(-{0})",
    "abs": "fabsf({0})",
    "exp": "expf({0})",
    "expm1": "expm1f({0})",
    "log": "logf({0})",
    "log1p": "log1pf({0})",
    "tanh": "tanhf({0})",
    "erf": "erff({0})",
    "sigmoid": "mw_sigmoid({0})",
    "sqrt": "sqrtf({0})",
    "gt": "({0} > {1})",
    "ge": "({0} >= {1})",
    "le": "({0} <= {1})",
    "and": "({0} && {1})",
    "select": "({0} ? {1} : {2})",
}


# ISPC spells a few functions differently (its stdlib has no tanh, erf, expm1 or log1p:
# tanh through exp, the others unsupported, see UNSUPPORTED_ISPC); max/min are the
# NaN-propagating mw_max/mw_min of group.ispc.j2, not ISPC's builtins (which drop a NaN).
ISPC_FUNCS: dict[str, str] = {
    **C_FUNCS,
    "abs": "abs({0})",
    "exp": "exp({0})",
    "log": "log({0})",
    "tanh": "mw_tanh({0})",
    "sqrt": "sqrt({0})",
}
# log: ISPC's own approximation, unchecked for NaN/inf/0 (no ispc binary on the test host)
UNSUPPORTED_ISPC = ("erf", "expm1", "log1p", "log")


def c_float(v: float) -> str:
    """A float literal (``-INFINITY``/``INFINITY`` for infinities)."""
    if math.isinf(v):
        return "INFINITY" if v > 0 else "-INFINITY"
    if math.isnan(v):
        return "NAN"
    return f"{float(v)!r}f" if "e" not in repr(float(v)) else f"{float(v):.9e}f"


def c_expr(
    expr: Expr,
    load: Callable[[Load], str],
    acc: str = "acc_v",
    table: dict[str, str] = C_FUNCS,
    param: Callable[[ParamVec], str] | None = None,
) -> str:
    """C text of ``expr``; ``load`` renders a :class:`Load` (the address arithmetic);
    ``table`` spells the functions (``C_FUNCS`` or ``ISPC_FUNCS``); ``param`` renders a
    :class:`ParamVec` (its element in the kernel's constant array, by default named
    ``ParamVec.name``)."""
    if isinstance(expr, Const):
        return c_float(expr.value)
    if isinstance(expr, Load):
        return load(expr)
    if isinstance(expr, ParamVec):
        return param(expr) if param is not None else f"{expr.name}[{expr.index}]"
    if isinstance(expr, Acc):
        return acc
    if isinstance(expr, Call):
        return table[expr.fn].format(*(c_expr(a, load, acc, table, param) for a in expr.args))
    raise TypeError(f"not an expression: {expr!r}")
