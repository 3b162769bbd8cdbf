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
    "exp": "mw_expf({0})",
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


# The scalar helpers the x86 C templates that print table expressions define (group,
# GEMV, Winograd, direct convolution: ``{{ scalar_helpers }}``, a global of
# render.environment(); winograd_f2's source by format): ``mw_expf`` and ``mw_sigmoid``.
SCALAR_HELPERS = r"""#include <stdint.h>
#include <string.h>
/* exp(x) in float, branch-free, so that gcc vectorises it in a SIMD loop (libm's expf is
   a call per element): x = n ln2 + r with n = round(x / ln2) and |r| <= ln2/2 (ln2 split
   in two, Cody-Waite), e^r by Cephes' expf polynomial, times 2^n applied as two powers of
   two so that a subnormal result rounds once and one past 88.72 is infinity. x is clamped
   to [-104, 89] first (-inf gives 0, inf gives inf); a NaN goes through every operation
   and comes out NaN. Under 1 ulp from the exact result over the whole range (every 41st
   float in [-110, 95] checked against float64: at most 0.997 ulp, mean 0.06). */
static inline float mw_expf(float x) {
  const float xc = x < -104.0f ? -104.0f : (x > 89.0f ? 89.0f : x);
  const float t = xc * 1.44269504088896341f + 12582912.0f; /* + 1.5 * 2^23: rounds n */
  const float n = t - 12582912.0f;
  int32_t ti;
  memcpy(&ti, &t, 4);
  const int32_t ni = ti - 0x4B400000;
  const float r = (xc - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const int32_t n1 = ni >> 1, n2 = ni - n1;
  /* unsigned shifts: a NaN's n is garbage, and a signed shift of it undefined */
  const uint32_t b1 = (uint32_t)(n1 + 127) << 23, b2 = (uint32_t)(n2 + 127) << 23;
  float s1, s2;
  memcpy(&s1, &b1, 4);
  memcpy(&s2, &b2, 4);
  return p * s1 * s2;
}
static inline float mw_sigmoid(float x) { return 1.0f / (1.0f + mw_expf(-x)); }
"""


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
# log and exp: ISPC's own approximations, unchecked for NaN/inf/0 (no ispc binary on the
# test host); a decomposed softmax takes exp of -inf and NaN routinely, so a group with exp
# runs as C (mw_expf, checked) instead
UNSUPPORTED_ISPC = ("erf", "expm1", "log1p", "log", "exp")


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
