"""Integer index expressions: the structured form of loop bounds, guards, divisors, buffer
origins and load indices in a schedule (``passes/schedule_ir.py``).

A schedule never carries target text: each backend prints these trees in its own syntax
(``to_c`` for C, ISPC and CUDA, which share C's integer expressions) or evaluates them
(``evaluate``, the reference backend: Python ints or numpy integer arrays).

The vocabulary mirrors what isl's AST builder produces (``isl_helpers.ix_from_ast``):

===========  =====  =====================================================================
op           arity  meaning
===========  =====  =====================================================================
add, mul     n>=2   sum, product
sub          2      difference
neg          1      negation
floordiv     2      floor(a / b), b > 0 (any sign of a)
div          2      a / b where a >= 0 or b divides a (C's truncating division is exact)
mod          2      a mod b, a >= 0 and b > 0 (C's ``%``)
min, max     n>=2
select       3      a ? b : c (a is a condition)
eq le lt     2      comparisons (conditions)
ge gt        2
and, or      n>=2   conditions
===========  =====  =====================================================================
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

ARITY: dict[str, int] = {
    "add": -2,
    "mul": -2,
    "sub": 2,
    "neg": 1,
    "floordiv": 2,
    "div": 2,
    "mod": 2,
    "min": -2,
    "max": -2,
    "select": 3,
    "eq": 2,
    "le": 2,
    "lt": 2,
    "ge": 2,
    "gt": 2,
    "and": -2,
    "or": -2,
}  # negative: at least that many arguments


@dataclasses.dataclass(frozen=True)
class Var:
    name: str

    def __str__(self) -> str:
        return self.name


@dataclasses.dataclass(frozen=True)
class Int:
    value: int

    def __str__(self) -> str:
        return str(self.value)


@dataclasses.dataclass(frozen=True)
class Op:
    op: str
    args: tuple[Ix, ...]

    def __post_init__(self) -> None:
        n = ARITY.get(self.op)
        if n is None:
            raise ValueError(f"unknown index operation {self.op!r}")
        if (n >= 0 and len(self.args) != n) or (n < 0 and len(self.args) < -n):
            raise ValueError(f"{self.op} with {len(self.args)} arguments")

    def __str__(self) -> str:
        return to_c(self)


Ix = Var | Int | Op


def op(name: str, *args: Ix) -> Op:
    return Op(name, tuple(args))


def variables(x: Ix) -> set[str]:
    """The variable names ``x`` reads."""
    if isinstance(x, Var):
        return {x.name}
    if isinstance(x, Op):
        return set().union(*(variables(a) for a in x.args))
    return set()


# ------------------------------------------------------------------------- C printer
# precedence of C's operators (higher binds tighter); calls and atoms are 100
_PREC = {
    "or": 1,
    "and": 2,
    "eq": 3,
    "le": 4,
    "lt": 4,
    "ge": 4,
    "gt": 4,
    "add": 5,
    "sub": 5,
    "mul": 6,
    "div": 6,
    "mod": 6,
    "neg": 7,
    "select": 0,
}
_INFIX = {
    "or": " || ",
    "and": " && ",
    "eq": " == ",
    "le": " <= ",
    "lt": " < ",
    "ge": " >= ",
    "gt": " > ",
    "add": " + ",
    "sub": " - ",
    "mul": " * ",
    "div": " / ",
    "mod": " % ",
}


def _c(x: Ix, names: Callable[[str], str]) -> tuple[str, int]:
    if isinstance(x, Var):
        return names(x.name), 100
    if isinstance(x, Int):
        return (str(x.value), 100) if x.value >= 0 else (f"({x.value})", 100)
    if x.op in ("min", "max", "floordiv"):
        fn = "floord" if x.op == "floordiv" else x.op
        args = [_c(a, names)[0] for a in x.args]
        text = args[0]
        for a in args[1:]:  # the C helpers take two arguments
            text = f"{fn}({text}, {a})"
        return text, 100
    if x.op == "select":
        c, t, f = (_c(a, names)[0] for a in x.args)
        return f"({c} ? {t} : {f})", 100
    if x.op == "neg":
        s, p = _c(x.args[0], names)
        # a negative operand is parenthesised: "--h" would be C's decrement
        return f"-{s if p >= 7 and not s.startswith('-') else f'({s})'}", 7
    prec = _PREC[x.op]
    parts = []
    for i, a in enumerate(x.args):
        s, p = _c(a, names)
        # left-associative: a right operand of equal precedence needs parentheses
        # (a - (b - c)); comparisons never chain without them
        need = p < prec or (p == prec and (i > 0 or prec in (3, 4)))
        if p == prec and x.op in ("add", "mul") and a.op == x.op:  # type: ignore[union-attr]
            need = False
        parts.append(f"({s})" if need else s)
    return _INFIX[x.op].join(parts), prec


def to_c(x: Ix | str, names: Callable[[str], str] = str) -> str:
    """C text of ``x`` (also valid ISPC and CUDA; uses the ``min``/``max``/``floord``
    helpers every C-like template defines). ``names`` maps a variable to its C name."""
    if isinstance(x, str):
        raise TypeError(f"index expressions are structured, not text: {x!r}")
    return _c(x, names)[0]


# ------------------------------------------------------------------------ evaluation
def _fold(fn: Callable[[Any, Any], Any], vals: list[Any]) -> Any:
    out = vals[0]
    for v in vals[1:]:
        out = fn(out, v)
    return out


_EVAL: dict[str, Callable[[list[Any]], Any]] = {
    "add": lambda v: _fold(lambda a, b: a + b, v),
    "mul": lambda v: _fold(lambda a, b: a * b, v),
    "sub": lambda v: v[0] - v[1],
    "neg": lambda v: -v[0],
    "floordiv": lambda v: v[0] // v[1],
    "div": lambda v: v[0] // v[1],
    "mod": lambda v: v[0] % v[1],
    "min": lambda v: _fold(np.minimum, v),
    "max": lambda v: _fold(np.maximum, v),
    "select": lambda v: np.where(v[0], v[1], v[2]),
    "eq": lambda v: v[0] == v[1],
    "le": lambda v: v[0] <= v[1],
    "lt": lambda v: v[0] < v[1],
    "ge": lambda v: v[0] >= v[1],
    "gt": lambda v: v[0] > v[1],
    "and": lambda v: _fold(np.logical_and, v),
    "or": lambda v: _fold(np.logical_or, v),
}


def evaluate(x: Ix, env: Mapping[str, Any]) -> Any:
    """The value of ``x`` with variables bound by ``env`` (ints or numpy integer arrays,
    which broadcast). Division and remainder are floor division and floor remainder,
    which agree with C's on the operands the vocabulary allows."""
    if isinstance(x, Int):
        return x.value
    if isinstance(x, Var):
        try:
            return env[x.name]
        except KeyError:
            raise KeyError(f"index variable {x.name!r} is not bound") from None
    v = _EVAL[x.op]([evaluate(a, env) for a in x.args])
    if isinstance(v, np.ndarray) and v.ndim == 0:
        return v.item()
    return int(v) if isinstance(v, np.integer) else v
