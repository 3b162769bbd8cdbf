"""The reference backend's spelling of the scalar function vocabulary
(``middleware.loops.FUNCTIONS``) in numpy float32, with PyTorch's semantics.

Every function takes and returns float32 arrays (or float32 scalars) and follows what the
C backend computes (``backends/x86/cfuncs.py`` and the helpers of its templates):

* ``max``/``min`` propagate a NaN operand whatever the order (``mw_max``/``mw_min``, as
  ``torch.maximum``, ``clamp``, ``relu`` and max-pooling do);
* conditions (``gt``, ``ge``, ``le``, ``and``) are 1.0 or 0.0; ``select(c, a, b)`` takes
  ``a`` where ``c`` is not zero (a NaN condition is true, as in C);
* ``sigmoid`` is ``1 / (1 + exp(-x))`` in float32, as ``mw_sigmoid``;
* ``erf`` is the correctly rounded double ``math.erf`` of each element, rounded to
  float32 (numpy has no erf).

A function missing here fails with :class:`MissingFunction`, naming it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

F32 = np.float32


class MissingFunction(NotImplementedError):
    """An expression uses a function the reference backend does not spell."""


def _f32(x: object) -> np.ndarray:
    return np.asarray(x, dtype=F32)


def _cond(x: np.ndarray) -> np.ndarray:
    return _f32(x)


def _max(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return _f32(np.where((a > b) | np.isnan(a), a, b))


def _min(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return _f32(np.where((a < b) | np.isnan(a), a, b))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    one = F32(1.0)
    return _f32(one / (one + np.exp(-_f32(x))))


_ERF = np.frompyfunc(math.erf, 1, 1)


def _erf(x: np.ndarray) -> np.ndarray:
    # np.asarray: on a 0-d operand frompyfunc returns a Python float
    return _f32(np.asarray(_ERF(np.asarray(x, dtype=np.float64)), dtype=np.float64))


FUNCTIONS: dict[str, Callable[..., np.ndarray]] = {
    "add": lambda a, b: _f32(np.add(a, b)),
    "sub": lambda a, b: _f32(np.subtract(a, b)),
    "mul": lambda a, b: _f32(np.multiply(a, b)),
    "div": lambda a, b: _f32(np.divide(a, b)),
    "max": _max,
    "min": _min,
    "neg": lambda a: _f32(np.negative(a)),
    "abs": lambda a: _f32(np.abs(a)),
    "exp": lambda a: _f32(np.exp(a)),
    "expm1": lambda a: _f32(np.expm1(a)),
    "log": lambda a: _f32(np.log(a)),
    "log1p": lambda a: _f32(np.log1p(a)),
    "tanh": lambda a: _f32(np.tanh(a)),
    "erf": _erf,
    "sigmoid": _sigmoid,
    "sqrt": lambda a: _f32(np.sqrt(np.asarray(a, dtype=np.float32))),
    "gt": lambda a, b: _cond(np.greater(a, b)),
    "ge": lambda a, b: _cond(np.greater_equal(a, b)),
    "le": lambda a, b: _cond(np.less_equal(a, b)),
    "and": lambda a, b: _cond(np.logical_and(np.not_equal(a, 0), np.not_equal(b, 0))),
    "select": lambda c, a, b: _f32(np.where(np.not_equal(c, 0), a, b)),
}


def apply(fn: str, args: list[np.ndarray]) -> np.ndarray:
    """``fn(*args)`` (float32); :class:`MissingFunction` for a function not spelled here."""
    try:
        f = FUNCTIONS[fn]
    except KeyError:
        raise MissingFunction(
            f"the reference backend has no spelling of function {fn!r} "
            f"(add it to FUNCTIONS in middleware/backends/reference/functions.py)"
        ) from None
    with np.errstate(all="ignore"):  # inf and NaN are values here, as in C
        return f(*args)
