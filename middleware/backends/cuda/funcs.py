"""The CUDA backend's one table from scalar function (``middleware.loops.FUNCTIONS``) to its
CUDA C spelling, and the printing of expressions and index trees as CUDA C.

An op's semantics are never spelled here: the loop semantics of the registry
(``middleware.ops``, ``middleware.loops``) build expressions over the closed function
vocabulary, and this table only says how CUDA C writes each function. Spellings follow
PyTorch's formulas (no fast-math intrinsics) and also compile as C++ on the CPU with
``emulate.h``; ``max``/``min`` propagate a NaN operand like the C backend's
``mw_max``/``mw_min`` (PyTorch's relu, clamp, max-pooling and ``torch.maximum``).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from ...errors import UnsupportedError
from ...index_expr import Ix, to_c
from ...loops import FUNCTIONS, Expr, Load, ParamVec
from ..x86.cfuncs import C_FUNCS, c_expr, c_float

# CUDA C spells every function of the vocabulary as C does (the same libm names, the same
# NaN-propagating mw_max/mw_min, defined below as device functions): the x86 table, but
# for exp (CUDA's expf, not the x86 helper mw_expf)
CUDA_FUNCS: dict[str, str] = {**C_FUNCS, "exp": "expf({0})"}

# The helpers the table's spellings call, defined once in every CUDA template (device
# functions; the CPU emulation compiles them as inline C++). ``a != a`` is isnan(a).
HELPERS = """\
#ifndef INFINITY  // NVRTC compiles without the host's math.h
#define INFINITY __int_as_float(0x7f800000)
#endif
#ifndef NAN
#define NAN __int_as_float(0x7fffffff)
#endif
static __device__ __forceinline__ float mw_max(float a, float b) { return (a > b || a != a) ? a : b; }
static __device__ __forceinline__ float mw_min(float a, float b) { return (a < b || a != a) ? a : b; }
static __device__ __forceinline__ float mw_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
static __device__ __forceinline__ int floord(int n, int d) { return n >= 0 ? n / d : -((-n + d - 1) / d); }
"""


def missing_functions() -> list[str]:
    """The functions of the vocabulary this table does not spell (none, when in sync)."""
    return sorted(set(FUNCTIONS) - set(CUDA_FUNCS))


def flt(v: float) -> str:
    """A float as a CUDA C single-precision literal (``INFINITY``/``NAN`` for those)."""
    text = c_float(float(v))
    return "(-INFINITY)" if text == "-INFINITY" else text


_NAME = re.compile(r"^[A-Za-z_][A-Za-z_0-9]*$|^\d+$")


def _wrapped(text: str) -> bool:
    """``text`` is one parenthesised expression (its first parenthesis closes last)."""
    if not (text.startswith("(") and text.endswith(")")):
        return False
    depth = 0
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0 and i < len(text) - 1:
            return False
    return True


def _paren(text: str) -> str:
    text = text.strip()
    return text if _NAME.match(text) or _wrapped(text) else f"({text})"


def index_c(x: Ix) -> str:
    """C text of an index tree (``middleware.index_expr``: a schedule's loop bounds, load
    indices, divisors, conditions), parenthesised unless it is a name, a number or
    parenthesised already."""
    return _paren(to_c(x))


def cuda_expr(
    expr: Expr,
    load: Callable[[Load], str],
    param: Callable[[ParamVec], str],
    acc: str = "acc_v",
) -> str:
    """CUDA C text of ``expr`` (the generic printer of the C backend with this table)."""
    missing = [f for f in _functions(expr) if f not in CUDA_FUNCS]
    if missing:
        raise UnsupportedError(f"the CUDA backend has no spelling for {sorted(set(missing))}")
    return c_expr(expr, load, acc, CUDA_FUNCS, param)


def _functions(expr: Expr) -> list[str]:
    args = getattr(expr, "args", None)
    if args is None:
        return []
    return [expr.fn] + [f for a in args for f in _functions(a)]  # type: ignore[union-attr]
