"""Graph passes: each a plain function ``Graph -> Graph`` that leaves its input untouched.

The pipeline is one named list, run by one short loop. ``Options.disable_passes`` switches
passes off by name; ``Options.debug_dir`` writes the graph after every pass as
``NNN_<pass>.txt``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from ..graph import Graph
from ..hardware import Hardware
from ..options import Options
from .layout import assign_layout

Pass = Callable[[Graph], Graph]

# (name, pass) in the order they run; filled in below as passes land.
PIPELINE: list[tuple[str, Pass]] = [
    # after fuse_vendor_epilogue, before classify
    ("layout", assign_layout),
]


def pass_names() -> list[str]:
    return [name for name, _ in PIPELINE]


def run_passes(
    graph: Graph,
    options: Options,
    hardware: Hardware | None = None,
    pipeline: list[tuple[str, Pass]] | None = None,
) -> Graph:
    """Run the pipeline (less the disabled passes) over ``graph``; returns the new graph.

    Per-pass times (seconds) are left in ``graph.meta["pass_times"]``.
    """
    pipeline = PIPELINE if pipeline is None else pipeline
    known = {name for name, _ in pipeline}
    unknown = [p for p in options.disable_passes if p not in known]
    if unknown:
        raise ValueError(
            f"unknown pass(es) {unknown} in disable_passes; passes are: "
            f"{', '.join(name for name, _ in pipeline)}"
        )
    debug = Path(options.debug_dir) if options.debug_dir else None
    if debug:
        debug.mkdir(parents=True, exist_ok=True)
        (debug / "000_input.txt").write_text(graph.text() + "\n")
    times: dict[str, float] = {}
    for i, (name, fn) in enumerate(pipeline, start=1):
        if name in options.disable_passes:
            continue
        t0 = time.perf_counter()
        graph = fn(graph)
        times[name] = time.perf_counter() - t0
        if debug:
            (debug / f"{i:03d}_{name}.txt").write_text(graph.text() + "\n")
    graph.meta["pass_times"] = times
    return graph
