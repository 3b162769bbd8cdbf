"""The constant tap range of a window loop, shared by the flat and the tiled CUDA forms: a
window whose taps span few values over all output points is rendered with a constant trip
count (unrolled) and a skip of the taps outside each point's window."""

from __future__ import annotations

import math

import numpy as np

from ...index_expr import evaluate, variables
from ...passes.schedule_ir import Loop

# A window loop whose taps span at most this many values over all output points, no more
# than the widest point's window, is rendered with a constant trip count (unrolled) and a
# skip of the taps outside the point's window (clipped at the input's border), instead of
# bounds that vary per point (a loop nvcc cannot unroll). Adaptive windows, whose taps are
# input indices moving with the point, keep their bounds.
MAX_UNROLLED_TAPS = 16
# ... when its bounds' variables span at most this many combinations (to find the span).
MAX_BOUND_POINTS = 1 << 16


def tap_range(lp: Loop, ranges: dict[str, tuple[int, int]]) -> tuple[int, int] | None:
    """(first, last) value loop ``lp`` takes at any point, its bounds evaluated over the
    ``ranges`` of the variables they read, when that span is short (``MAX_UNROLLED_TAPS``)
    and no wider than the widest point's window; else None."""
    names = sorted(variables(lp.lo) | variables(lp.hi))
    if any(v not in ranges for v in names):
        return None
    if math.prod(ranges[v][1] - ranges[v][0] + 1 for v in names) > MAX_BOUND_POINTS:
        return None
    axes = [np.arange(ranges[v][0], ranges[v][1] + 1) for v in names]
    env = dict(zip(names, np.meshgrid(*axes, indexing="ij"), strict=True))
    lo = np.broadcast_to(np.asarray(evaluate(lp.lo, env)), np.shape(env[names[0]]) if names else ())
    hi = np.broadcast_to(np.asarray(evaluate(lp.hi, env)), lo.shape)
    runs = hi >= lo
    if not np.any(runs):
        return None
    first, last = int(lo[runs].min()), int(hi[runs].max())
    widest = int((hi - lo)[runs].max()) + 1
    if last - first + 1 > min(widest, MAX_UNROLLED_TAPS):
        return None
    return first, last
