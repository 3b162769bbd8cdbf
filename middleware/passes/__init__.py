"""Graph passes: each a plain function ``Graph -> Graph`` that leaves its input untouched.

The pipeline is one named list, run by one short loop. Passes that depend on the device
(the post-op table of ``fuse_vendor_epilogue``, the roofline of ``classify``) receive the
``Hardware`` through ``functools.partial``, so :func:`make_pipeline` builds the list for one
device; ``PIPELINE`` is that list for the documented CPU defaults (its names are the same
for every device). ``Options.disable_passes`` switches passes off by name;
``Options.debug_dir`` writes the graph after every pass as ``NNN_<pass>.txt``.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from pathlib import Path

from ..graph import Graph
from ..hardware import CPU_DEFAULTS, Hardware
from ..options import Options
from .canonicalize import canonicalize
from .classify import classify
from .decompose_layer_norm import decompose_layer_norm
from .decompose_softmax import decompose_softmax
from .fold_batchnorm import fold_batchnorm
from .fuse_depthwise import fuse_depthwise, fuse_stem
from .fuse_vendor_epilogue import fuse_vendor_epilogue
from .group import group
from .layout import assign_layout
from .merge_concat import merge_concat
from .merge_pool_relu import merge_pool_relu
from .pool_before_concat import pool_before_concat

Pass = Callable[[Graph], Graph]

# The passes that write an ATen call as its definition over registry ops so that it fuses:
# off in training (their reductions over a map's last dims have no backward rule), on CUDA
# (unmeasured there) and with fuse=False (the pieces would run as separate calls)
DECOMPOSITIONS: tuple[str, ...] = ("decompose_layer_norm", "decompose_softmax")

# The documented CPU defaults (middleware/hardware.py), for PIPELINE and for callers that
# pass no Hardware.
DEFAULT_HARDWARE = Hardware(
    kind="cpu",
    name="default",
    cores=2,
    simd_bytes=64,
    l1_bytes=48 * 1024,
    l2_bytes=2 * 1024 * 1024,
    l3_bytes=32 * 1024 * 1024,
    **CPU_DEFAULTS,
)


def make_pipeline(hardware: Hardware, layout: str = "auto") -> list[tuple[str, Pass]]:
    """The passes, in the order they run, for a device described by ``hardware``;
    ``layout`` is ``Options.layout`` ("auto", "nchw" or "nhwc")."""
    return [
        ("canonicalize", canonicalize),
        ("decompose_layer_norm", decompose_layer_norm),
        ("decompose_softmax", decompose_softmax),
        ("fold_batchnorm", fold_batchnorm),
        ("merge_concat", merge_concat),
        # shared=True: also a pooling whose concat other ops read (googlenet's and
        # inception_v3's branch poolings); in a fused group the pooled parts are written
        # straight into their slices, so reading the parts costs what reading the concat did
        ("pool_before_concat", functools.partial(pool_before_concat, shared=True)),
        ("merge_pool_relu", merge_pool_relu),
        ("fuse_vendor_epilogue", functools.partial(fuse_vendor_epilogue, hardware=hardware)),
        ("layout", functools.partial(assign_layout, hardware=hardware, layout=layout)),
        ("fuse_depthwise", functools.partial(fuse_depthwise, hardware=hardware)),
        ("fuse_stem", functools.partial(fuse_stem, hardware=hardware)),
        ("classify", functools.partial(classify, hardware=hardware)),
        ("group", functools.partial(group, hardware=hardware)),
    ]


# (name, pass) in the order they run, for the documented CPU defaults.
PIPELINE: list[tuple[str, Pass]] = make_pipeline(DEFAULT_HARDWARE)


def pass_names() -> list[str]:
    return [name for name, _ in PIPELINE]


def run_passes(
    graph: Graph,
    options: Options,
    hardware: Hardware | None = None,
    pipeline: list[tuple[str, Pass]] | None = None,
) -> Graph:
    """Run the pipeline (less the disabled passes) over ``graph``; returns the new graph.

    ``pipeline`` defaults to ``make_pipeline(hardware)`` (``PIPELINE`` without hardware).
    Per-pass times (seconds) are left in ``graph.meta["pass_times"]`` of the result.
    """
    if pipeline is None:
        pipeline = make_pipeline(hardware or DEFAULT_HARDWARE, options.layout)
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
    original = graph
    for i, (name, fn) in enumerate(pipeline, start=1):
        if name in options.disable_passes:
            continue
        t0 = time.perf_counter()
        graph = fn(graph)
        times[name] = time.perf_counter() - t0
        if debug:
            (debug / f"{i:03d}_{name}.txt").write_text(graph.text() + "\n")
    if graph is original:  # every pass switched off: still hand back a new graph
        graph = graph.copy()
    graph.meta["pass_times"] = times
    return graph
