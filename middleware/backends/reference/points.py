"""The one-thread-per-output reading of a schedule (what backends/cuda renders), run in
numpy over all output points at once.

Every element of the final output is computed on its own from its coordinates
``(n, c, h, w)``: by the stage writing the output whose ``covers`` holds there, as
``expr`` with ``Acc`` = ``op`` of ``body`` over the ``Reduction.point_loops`` taps (from
``init``) divided by ``divisor``. A load of a scratch value is that value's stage
evaluated at the load's index (recomputed, as a thread without shared memory would).
Tiles, guards, scratch origins and extents play no part; bounds of the point loops,
covers and divisors may only use the output coordinates (and outer window variables).

This checks the parts of a schedule the tiled reading (``backend.py``) does not use:
``point_loops`` and ``covers``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ...index_expr import evaluate
from ...loops import DIMS, Acc, Call, Const, Expr, Load, ParamVec
from ...passes.schedule_ir import Buffer, Schedule, Stage
from .functions import apply

F32 = np.float32


class _Points:
    def __init__(self, s: Schedule, inputs: Sequence[np.ndarray], error: type[Exception]) -> None:
        self.s = s
        self.error = error
        self.by_value = {b.value: b for b in s.buffers}
        self.mem = dict(zip(s.inputs, inputs, strict=True))
        self.params = {p.name: p.array() for p in s.params}
        self.writers: dict[str, list[Stage]] = {}
        for st in s.stages:
            self.writers.setdefault(st.target, []).append(st)

    def run(self) -> np.ndarray:
        out = self.s.buffer(self.s.outputs[0])
        grids = np.meshgrid(*(np.arange(e) for e in out.shape), indexing="ij")
        env = {d: g.reshape(-1) for d, g in zip(DIMS, grids, strict=True)}
        logical = self.value_at(out, env).reshape(out.shape)
        # the logical (n, c, h, w) array in the output's memory order
        order = (0, 2, 3, 1) if out.layout == "nhwc" else (0, 1, 2, 3)
        return np.ascontiguousarray(logical.transpose(order)).reshape(-1)

    def value_at(self, b: Buffer, env: dict[str, Any]) -> np.ndarray:
        """Elements of the value of buffer ``b`` at the points ``env`` (arrays n, c, h, w)."""
        size = np.broadcast(*(np.asarray(env[d]) for d in DIMS)).size
        out = np.full(size, np.nan, dtype=F32)
        done = np.zeros(size, dtype=bool)
        for st in self.writers[b.name]:
            mask = np.ones(size, dtype=bool)
            if st.covers is not None:
                mask &= np.broadcast_to(evaluate(st.covers, env), (size,))
            mask &= ~done
            if not mask.any():
                continue
            sub = {d: np.broadcast_to(np.asarray(env[d]), (size,))[mask] for d in DIMS}
            out[mask] = np.broadcast_to(self.stage_at(st, sub), (int(mask.sum()),))
            done |= mask
        if not done.all():
            raise self.error(f"no stage covers {int((~done).sum())} elements of {b.value}")
        return out

    def stage_at(self, st: Stage, env: dict[str, Any]) -> np.ndarray:
        red = st.reduction
        if red is None:
            return self.expr(st.expr, env)
        size = env["n"].size
        acc = np.full(size, red.init, dtype=F32)
        self.reduce(red, list(red.point_loops), env, np.ones(size, dtype=bool), acc)
        if red.divisor is not None:
            acc = apply("div", [acc, np.asarray(evaluate(red.divisor, env), dtype=F32)])
        return self.expr(st.expr, env, acc)

    def reduce(self, red: Any, loops: list, env: dict, live: np.ndarray, acc: np.ndarray) -> None:
        """Accumulate ``red.body`` into ``acc`` at the points ``live`` over ``loops``."""
        if not loops:
            sub = {k: (v[live] if isinstance(v, np.ndarray) else v) for k, v in env.items()}
            body = np.broadcast_to(self.expr(red.body, sub), (int(live.sum()),))
            acc[live] = apply("max" if red.op == "max" else "add", [acc[live], body])
            return
        lp, rest = loops[0], loops[1:]
        lo = np.broadcast_to(evaluate(lp.lo, env), live.shape)
        hi = np.broadcast_to(evaluate(lp.hi, env), live.shape)
        if not live.any():
            return
        for k in range(int(lo[live].min()), int(hi[live].max()) + 1):
            inside = live & (lo <= k) & (k <= hi)
            if inside.any():
                self.reduce(red, rest, {**env, lp.var: k}, inside, acc)

    def expr(self, e: Expr, env: dict, acc: np.ndarray | None = None) -> np.ndarray:
        if isinstance(e, Const):
            return F32(e.value)  # type: ignore[return-value]
        if isinstance(e, Load):
            return self.load(e, env)
        if isinstance(e, ParamVec):
            return self.params[e.name][np.asarray(evaluate(e.index, env))]  # type: ignore[arg-type]
        if isinstance(e, Acc):
            assert acc is not None
            return acc
        if isinstance(e, Call):
            return apply(e.fn, [self.expr(a, env, acc) for a in e.args])
        raise TypeError(f"not an expression: {e!r}")

    def load(self, x: Load, env: dict) -> np.ndarray:
        b = self.by_value[x.value]
        index = [np.asarray(evaluate(i, env)) for i in x.index]
        if b.role == "scratch":  # recompute the value where it is read
            return self.value_at(b, dict(zip(DIMS, index, strict=True)))
        if b.role != "input":
            raise self.error(f"a stage reads the output {b.value}")
        addr: Any = 0
        for d in range(4):
            if b.extent[d] == 1:
                continue
            if index[d].size and (index[d].min() < 0 or index[d].max() >= b.extent[d]):
                raise self.error(f"a point reads {b.value} outside it along {DIMS[d]}")
            addr = addr + index[d] * b.strides[d]
        return self.mem[b.name][addr]


def run_points(
    schedule: Schedule, inputs: Sequence[np.ndarray], error: type[Exception]
) -> np.ndarray:
    """The flat output (its memory order) of ``schedule`` read one output point at a time,
    from flat inputs; ``error`` is raised where the schedule is wrong."""
    return _Points(schedule, inputs, error).run()
