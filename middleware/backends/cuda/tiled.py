"""Shared-memory tiles for groups around one overlapping window (pooling).

A group ``pointwise* -> window -> pointwise*`` (e.g. BN -> ReLU -> 3x3/2 max-pool) rendered
one thread per output recomputes the window's input for every tap and re-reads each input
element up to kh*kw/(sh*sw) times through L1/L2 (2.25 times for 3x3/2). Here a block owns
one tile of the output: it first computes the window's input over the tile's region (halo
included) ONCE, reading the group's inputs coalesced, into shared memory; after a barrier
every thread computes its outputs from shared memory. Tile shapes come from the shared
memory per block and the warp width:

- NCHW (W contiguous): a tile is TOH full output rows of one (n, c) plane; its region is
  the input rows those windows cover, full width.
- NHWC (C contiguous): a tile is TOH x TOW output pixels of TC = min(C, warp) channels; its
  region is the covered input pixels of those channels.

The element functions are the backend's own (``elements.py``), so the op semantics are not
spelled again: the window's input is the element function of its value (pulled through the
pointwise producers from memory) in the load phase, and a shared-memory accessor in the
compute phase.

The kernel's two phases are separate functions, so the CPU emulation runs them thread by
thread with the barrier between (``mw_emulate_*`` below), exactly what the GPU computes.
"""

from __future__ import annotations

import dataclasses

from ...errors import UnsupportedError
from ...graph import Node
from ...hardware import Hardware
from ...ops import get_op
from .elements import cident, element_functions, why_unsupported
from .group import KernelGroup
from .render import (
    BLOCKS_PER_SM,
    WARPS_PER_BLOCK,
    LaunchConfig,
    RenderedKernel,
    environment,
    kernel_name,
    render_group,
    value_names,
)

WINDOW_OPS = ("max_pool2d", "maxpool_relu", "avg_pool2d")
# Shared memory per block: 16 KiB keeps 8 blocks of 256 threads resident per SM (the whole
# thread budget) on every architecture from sm_80 on.
SMEM_FLOATS = 4096


@dataclasses.dataclass(frozen=True)
class TilePlan:
    """How a window group is tiled: the window node, its input value, and the tile."""

    window: Node
    value: str  # the window's input
    layout: str  # "nchw" | "nhwc"
    toh: int
    tow: int  # NCHW: the full output width
    tc: int  # NHWC: channels per tile; NCHW: 1
    rows_in: int  # region rows at most
    cols_in: int  # region columns at most (NCHW: the full input width)

    @property
    def smem_floats(self) -> int:
        return self.rows_in * self.cols_in * self.tc


def _pair(v: object) -> tuple[int, int]:
    if isinstance(v, int):
        return (v, v)
    v = tuple(v)  # type: ignore[arg-type]
    return (int(v[0]), int(v[0])) if len(v) == 1 else (int(v[0]), int(v[1]))


def _geometry(n: Node) -> tuple[tuple[int, int], ...]:
    k = _pair(n.attrs["kernel_size"])
    s = _pair(n.attrs.get("stride") or n.attrs["kernel_size"])
    p = _pair(n.attrs.get("padding", 0))
    d = _pair(n.attrs.get("dilation", 1)) if n.op != "avg_pool2d" else (1, 1)
    return k, s, p, d


def _span(t: int, k: int, s: int, d: int) -> int:
    """Input extent the windows of ``t`` consecutive outputs cover."""
    return (t - 1) * s + (k - 1) * d + 1


def tile_plan(group: KernelGroup, hardware: Hardware) -> TilePlan | None:
    """The tiling of ``group``, or None when it is not ``pointwise* -> one overlapping
    window -> pointwise*`` with one rank-4 output (then one thread per output is used)."""
    windows = [n for n in group.nodes if n.op in WINDOW_OPS]
    if len(windows) != 1 or len(group.outputs) != 1 or why_unsupported(group):
        return None
    w = windows[0]
    if "kernel_size" not in w.attrs or any(
        n is not w and not get_op(n.op).elementwise for n in group.nodes
    ):
        return None
    v, out = w.inputs[0], group.types[group.outputs[0]]
    vt = group.types[v]
    if vt.rank != 4 or out.rank != 4 or vt.layout != out.layout or v in group.outputs:
        return None
    (kh, kw), (sh, sw), _, (dh, dw) = _geometry(w)
    if kh * kw <= sh * sw:  # windows do not overlap: each input element is read once
        return None
    _, c, _, width = vt.shape
    _, _, oh, ow = group.types[w.outputs[0]].shape
    if vt.layout == "nhwc":
        tc = min(c, max(1, hardware.warp_size or 32))
        pixels = SMEM_FLOATS // tc
        t = 1
        while t < max(oh, ow) and _span(t + 1, kh, sh, dh) * _span(t + 1, kw, sw, dw) <= pixels:
            t += 1
        toh, tow = min(t, oh), min(t, ow)
        rows, cols = _span(toh, kh, sh, dh), _span(tow, kw, sw, dw)
        if rows * cols > pixels:
            return None
        return TilePlan(w, v, "nhwc", toh, tow, tc, rows, cols)
    rows_max = SMEM_FLOATS // width
    if rows_max < _span(1, kh, sh, dh):
        return None
    toh = min(oh, (rows_max - _span(1, kh, sh, dh)) // sh + 1)
    return TilePlan(w, v, "nchw", toh, ow, 1, _span(toh, kh, sh, dh), width)


def _downstream(group: KernelGroup, window: Node) -> set[str]:
    """Values computed from the window's output (the window's own included)."""
    after = set(window.outputs)
    for n in group.nodes:
        if any(v in after for v in n.inputs):
            after.update(n.outputs)
    return after


def render_tiled(
    group: KernelGroup, plan: TilePlan, hardware: Hardware, emulate: bool = True
) -> RenderedKernel:
    """The CUDA C source of ``group`` tiled by ``plan``, and its launch configuration."""
    if len(group.outputs) != 1:
        raise UnsupportedError(f"group {group.name}: a tiled kernel writes one output")
    taken: set[str] = {"a", "idx", "r", "step", "sm"}
    names = value_names(group, taken)
    tile_name = cident(plan.value + "_tile", taken)
    after = _downstream(group, plan.window)
    # pulled from memory: inputs and everything not computed from the window's output;
    # from the tile: the window and what follows it, reading the window's input in smem
    pulled = [f for f in element_functions(group, names) if f.value not in after]
    tiled_names = dict(names, **{plan.value: tile_name})
    tiled = [f for f in element_functions(group, tiled_names) if f.value in after]
    out_v = group.outputs[0]
    out_t = group.types[out_v]
    n_, c, h, w = group.types[plan.value].shape
    _, _, oh, ow = out_t.shape
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = _geometry(plan.window)
    th_tiles = -(-oh // plan.toh)
    tw_tiles = -(-ow // plan.tow)
    ct_tiles = -(-c // plan.tc)
    tiles = n_ * th_tiles * tw_tiles * ct_tiles if plan.layout == "nhwc" else n_ * c * th_tiles
    block = max(1, hardware.warp_size or 32) * WARPS_PER_BLOCK
    grid = max(1, min(tiles, max(1, hardware.cores) * BLOCKS_PER_SM))
    name = kernel_name(group)
    ins = [{"value": v, "cname": names[v], "type": str(group.types[v])} for v in group.inputs]
    source = (
        environment()
        .get_template("tiled.cu.j2")
        .render(
            kernel=name,
            description=group.describe(),
            inputs=ins,
            out={"value": out_v, "cname": names[out_v], "type": str(out_t)},
            pulled=pulled,
            tiled=tiled,
            value_cname=names[plan.value],
            tile_cname=tile_name,
            plan=plan,
            N=n_, C=c, H=h, W=w, OH=oh, OW=ow,
            kh=kh, kw=kw, sh=sh, sw=sw, ph=ph, pw=pw, dh=dh, dw=dw,
            th_tiles=th_tiles, tw_tiles=tw_tiles, ct_tiles=ct_tiles,
            tiles=tiles, block=block, grid=grid,
            smem=plan.smem_floats,
            emulate=emulate,
        )
    )  # fmt: skip
    return RenderedKernel(
        name,
        source,
        group.inputs,
        group.outputs,
        tuple(group.types[v] for v in group.inputs),
        (out_t,),
        LaunchConfig(grid, block, tiles),
        group,
    )


def render_kernel(
    group: KernelGroup, hardware: Hardware, emulate: bool = True, tiled: bool = True
) -> RenderedKernel:
    """The group's kernel: shared-memory tiles where ``tile_plan`` finds a tiling (and
    ``tiled``), else one thread per output element (``render_group``)."""
    plan = tile_plan(group, hardware) if tiled else None
    if plan is not None:
        return render_tiled(group, plan, hardware, emulate)
    return render_group(group, hardware, emulate)
